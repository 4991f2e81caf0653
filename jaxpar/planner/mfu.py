"""Model FLOPs utilization of a training run: the model's FLOPs per step over what the devices could do.

The FLOPs come from the config by the planner's formula (`jaxpar.planner.planner.flops_per_token`:
6 N per token for the matmuls forward and backward plus 12 L s h hd for attention),
so MFU here and in `jaxpar plan` are one number. The peak is the device's dense
(no 2:4 sparsity) datasheet figure, looked up by `jax.devices()[0].device_kind`,
or `--peak-flops`. Where neither is known (the CPU, an unlisted device) there is no
MFU: a made-up peak would give a made-up fraction.
"""

from __future__ import annotations

import dataclasses

# Dense peak FLOP/s per device: (bf16/fp16, fp32 as JAX runs an fp32 matmul by default). JAX's default matmul
# precision runs fp32 matmuls on NVIDIA tensor cores as TF32 and on TPUs as bf16 passes, so the fp32 column is
# the TF32 figure on NVIDIA and the bf16 one on TPUs; with jax_default_matmul_precision="highest" the true peak
# is lower and MFU reads low, never high. Sources: NVIDIA's H100 / H200 / A100 datasheets and the HGX B200
# spec table (whose Tensor Core figures are with sparsity: halved here); Google Cloud TPU docs (System
# architecture: v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s bf16 per chip).
# Entries are matched in order, case-insensitively, as substrings of device_kind ("NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "TPU v5 lite", "TPU v5", ...): the more specific first.
PEAKS: tuple[tuple[str, str, float, float], ...] = (
    # (substring of device_kind, name, bf16 FLOP/s, fp32 FLOP/s)
    ("h100 pcie", "H100 PCIe", 756e12, 378e12),
    ("h100 nvl", "H100 NVL", 835e12, 418e12),
    ("h100", "H100 SXM", 989e12, 495e12),
    ("h200 nvl", "H200 NVL", 835e12, 418e12),
    ("h200", "H200 SXM", 989e12, 495e12),
    ("a100", "A100", 312e12, 156e12),
    ("b200", "B200", 2.25e15, 1.1e15),
    ("tpu v4 lite", None, 0.0, 0.0),  # v4i: an inference chip with no published training peak: not guessed
    ("tpu v4", "TPU v4", 275e12, 275e12),
    ("tpu v5 lite", "TPU v5e", 197e12, 197e12),
    ("tpu v5e", "TPU v5e", 197e12, 197e12),
    ("tpu v5", "TPU v5p", 459e12, 459e12),  # v5p reports device_kind "TPU v5"
    ("tpu v6 lite", "TPU v6e", 918e12, 918e12),
    ("tpu v6e", "TPU v6e", 918e12, 918e12),
)


def device_peak(device_kind: str, precision: str = "bf16") -> tuple[float, str] | None:
    """(peak FLOP/s of one device, the entry's name) for a device_kind and plan precision, or None if not listed."""
    kind = device_kind.lower()
    for key, name, bf16, fp32 in PEAKS:
        if key in kind:
            return ((fp32 if precision == "fp32" else bf16), name) if name else None
    return None


def model_flops_per_step(name: str, config, batch_size: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step (forward and backward, no recomputation) over the whole batch."""
    from jaxpar.planner.planner import Model, flops_per_token, llama_leaves

    model = Model.from_config(name, config, llama_leaves(config))
    return flops_per_token(model, seq_len) * batch_size * seq_len


@dataclasses.dataclass(frozen=True)
class Mfu:
    """What turns a step time into MFU: FLOPs per step and the summed peak of the devices (None: no MFU)."""

    flops_per_step: float
    peak: float | None  # FLOP/s of all devices together
    why_not: str = ""  # why there is no peak, for the person reading the progress

    def __call__(self, step_time_s: float) -> float | None:
        if self.peak is None or step_time_s <= 0:
            return None
        return self.flops_per_step / (step_time_s * self.peak)


def for_run(name: str, config, batch_size: int, seq_len: int, precision: str, devices: list,
            peak_flops: float | None = None) -> Mfu:
    """The run's MFU: `peak_flops` (per device) if given, else the table's peak for the devices, else none."""
    flops = model_flops_per_step(name, config, batch_size, seq_len)
    if peak_flops is not None:
        return Mfu(flops, peak_flops * len(devices))
    kind, platform = devices[0].device_kind, devices[0].platform
    if platform == "cpu":
        return Mfu(flops, None, "n/a (CPU)")
    found = device_peak(kind, precision)
    if found is None:
        return Mfu(flops, None, f"n/a (no peak known for {kind!r}: give --peak-flops)")
    return Mfu(flops, found[0] * len(devices))

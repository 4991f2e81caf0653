"""What the devices a plan runs on are: the one place a code path reads the hardware from.

Every backend-dependent choice (attention's kernel, flash attention's blocks,
XLA:CPU's workarounds, the memory kinds offload needs, the MFU peak, the GPU
flag profile) follows these facts, read from the plan's mesh devices: the
process's own devices, or a compile-only target's (`jaxpar.core.target`), whose
memory and memory kinds come from the target, since a deviceless compile's
devices report none. Nothing here reads `jax.devices()` except `current()`
outside any plan, where the default device is what the code runs on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxpar.core.trace import active_plan

# Dense peak FLOP/s per device: (bf16/fp16, fp32 as JAX runs an fp32 matmul by default). JAX's default matmul
# precision runs fp32 matmuls on NVIDIA tensor cores as TF32 and on TPUs as bf16 passes, so the fp32 column is
# the TF32 figure on NVIDIA and the bf16 one on TPUs; with jax_default_matmul_precision="highest" the true peak
# is lower and MFU reads low, never high. Sources: NVIDIA's H100 / H200 / A100 datasheets and the HGX B200
# spec table (whose Tensor Core figures are with sparsity: halved here); Google Cloud TPU docs (System
# architecture: v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s bf16 per chip).
# Entries are matched in order, case-insensitively, as substrings of device_kind ("NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "TPU v5 lite", "TPU v5", ...): the more specific first.
PEAKS: tuple[tuple[str, str | None, float, float], ...] = (
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
GPU_MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")  # what a real CUDA device reports


def device_peak(device_kind: str, precision: str = "bf16") -> tuple[float, str] | None:
    """(peak FLOP/s of one device, the entry's name) for a device_kind and plan precision, or None if not listed."""
    kind = device_kind.lower()
    for key, name, bf16, fp32 in PEAKS:
        if key in kind:
            return ((fp32 if precision == "fp32" else bf16), name) if name else None
    return None


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """The hardware a plan's step is compiled for.

    backend: "cpu", "gpu" or "tpu" (jax's platform); kind: the device_kind; memory: bytes per device (None where
    the backend does not say); memory_kinds: the memory spaces a device has ("device", "pinned_host", ...);
    hosts: processes (hosts) the devices sit on; devices: how many; target: the compile-only target's name, or ""
    for devices of this process; cudnn: False where a target's compile could not load cuDNN (not installed here).
    """

    backend: str
    kind: str
    memory: int | None
    memory_kinds: tuple[str, ...]
    hosts: int
    devices: int
    target: str = ""
    cudnn: bool = True  # whether cuDNN can be loaded for a compile (a target's needs the library here)

    @property
    def nvidia(self) -> bool:
        return self.kind.startswith("NVIDIA")

    def peak_flops(self, precision: str = "bf16") -> float | None:
        """Dense peak FLOP/s of one device in `precision` (`PEAKS`), None where not listed (the CPU, others)."""
        found = None if self.backend == "cpu" else device_peak(self.kind, precision)
        return None if found is None else found[0]


_TARGET_FACTS: dict[int, DeviceFacts] = {}  # id(device) of a target's compile-only devices -> their facts
_TARGET_DEVICES: list = []  # keeps those devices alive, so that their ids stay theirs


def register_target(devices, facts: DeviceFacts) -> None:
    """Record the facts of a compile-only target's devices (jaxpar.core.target), which report no memory."""
    for device in devices:
        _TARGET_FACTS[id(device)] = facts
    _TARGET_DEVICES.append(tuple(devices))


def of_devices(devices) -> DeviceFacts:
    """The facts of `devices` (a sequence or array of jax devices; the first decides kind and memory)."""
    devices = list(getattr(devices, "flat", devices))
    first = devices[0]
    if id(first) in _TARGET_FACTS:
        return _TARGET_FACTS[id(first)]
    try:
        kinds = tuple(m.kind for m in first.addressable_memories())
    except Exception:  # noqa: BLE001 - a device that cannot list its memories has none to offer
        kinds = ()
    stats = None
    try:
        stats = first.memory_stats()
    except Exception:  # noqa: BLE001 - not addressable, or the backend keeps no statistics (XLA:CPU)
        pass
    memory = int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None
    hosts = len({getattr(d, "process_index", 0) for d in devices})  # a stand-in device may lack one
    return DeviceFacts(first.platform, first.device_kind, memory, kinds, hosts, len(devices))


@functools.lru_cache(maxsize=64)
def of_mesh(mesh) -> DeviceFacts:
    """The facts of a mesh's devices (read once per mesh: every traced layer asks)."""
    return of_devices(mesh.devices)


def current() -> DeviceFacts:
    """The facts of the active plan's mesh; outside a plan, of the default device (what plain code runs on)."""
    plan = active_plan()
    return of_mesh(plan.mesh) if plan is not None else _default()


@functools.cache
def _default() -> DeviceFacts:
    return of_devices(jax.devices()[:1])

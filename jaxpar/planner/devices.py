"""Accelerator specs for the planner: memory, peak FLOP/s and link bandwidths of one device.

Figures are the vendors' datasheet numbers (HBM capacity and bandwidth; the
peak FLOP/s come from the one table `PEAKS`, which training's MFU
(jaxpar.planner.mfu) reads too) and the usual node build: 8 GPUs on NVLink/NVSwitch,
one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU; TPU v5p chips all on
ICI within a pod. Bandwidths are what one device can send per second
(unidirectional), the quantity ring traffic is divided by. Any other device
comes from a TOML file with the same field names.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from jaxpar.core.device_facts import PEAKS, DeviceFacts, device_peak  # noqa: F401 - PEAKS: public here too

GB = 1e9
GiB = 2**30

# The peak FLOP/s table (PEAKS) and its lookup live with the device facts every layer reads.


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator and its links.

    hbm: bytes of device memory; usable: share of it a step may plan on (the rest
    is the runtime's, fragmentation, NCCL buffers); peak_flops: dense bf16
    FLOP/s; fp32_flops: dense FLOP/s of an fp32 matmul at JAX's default precision; efficiency: share of peak that large
    matmuls reach; hbm_bandwidth: bytes/s; intra_bandwidth / inter_bandwidth:
    bytes/s one device sends to a peer inside / outside its node;
    devices_per_node: how many devices share the fast links; widens_low_precision:
    the backend runs bf16/fp16 collectives in fp32 (XLA:CPU does); low_precision_in_fp32: it also
    keeps bf16/fp16 activations and gradients in fp32 (XLA:CPU before jaxlib 0.11); scatter_as_all_reduce: the
    backend lowers a reduce-scatter that sharding annotations ask for to an all-reduce and a slice
    (XLA:CPU does; jaxpar's explicit forms write true reduce-scatters); sums_apart: the backend all-reduces
    each of two partial sums that are then added (a capacity-routed MoE layer's gate and up input gradients)
    instead of their sum, and a ZeRO-3 layer's recomputed expert output again (XLA:CPU); host_bandwidth: bytes/s between
    device and host memory one way (PCIe Gen5 x16 for the GPUs), what `--offload optimizer` moves over.
    """

    name: str
    hbm: float
    peak_flops: float
    fp32_flops: float
    hbm_bandwidth: float
    intra_bandwidth: float
    inter_bandwidth: float
    devices_per_node: int
    usable: float = 0.9
    efficiency: float = 0.75
    widens_low_precision: bool = False
    low_precision_in_fp32: bool = False
    scatter_as_all_reduce: bool = False
    sums_apart: bool = False
    host_bandwidth: float = 55 * GB
    ragged_exchange: bool = True  # XLA has ragged-all-to-all (a MoE layer's rows sent exactly; XLA:CPU has none)

    @property
    def capacity(self) -> float:
        """Bytes a plan may use per device."""
        return self.hbm * self.usable

    def flops(self, precision: str) -> float:
        """Peak FLOP/s for the step's compute dtype."""
        return self.fp32_flops if precision == "fp32" else self.peak_flops

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _old_xla_cpu() -> bool:
    """Whether the installed XLA:CPU (jaxlib < 0.11) computes bf16/fp16 values in fp32 (measured, jaxlib 0.10 and 0.12)."""
    from importlib.metadata import version

    try:
        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except Exception:  # noqa: BLE001 - no jaxlib metadata: assume a current one
        return False
    return (major, minor) < (0, 11)


def _peaks(device_kind: str) -> tuple[float, float]:
    """(bf16, fp32) peak FLOP/s of a device as `PEAKS` lists it (its device_kind)."""
    return device_peak(device_kind, "bf16")[0], device_peak(device_kind, "fp32")[0]


DEVICES: dict[str, Device] = {
    # H100 SXM: 80 GB HBM3 at 3.35 TB/s, NVLink 4 (900 GB/s both ways), 400 Gb/s IB per GPU.
    "h100": Device("H100 SXM 80GB", 80 * GB, *_peaks("NVIDIA H100 80GB HBM3"), 3.35e12, 450 * GB, 50 * GB, 8),
    # H200 SXM: an H100 with 141 GB HBM3e at 4.8 TB/s.
    "h200": Device("H200 SXM 141GB", 141 * GB, *_peaks("NVIDIA H200"), 4.8e12, 450 * GB, 50 * GB, 8),
    # A100 SXM 80GB: NVLink 3 (600 GB/s both ways), 200 Gb/s HDR IB per GPU.
    "a100": Device("A100 SXM 80GB", 80 * GB, *_peaks("NVIDIA A100-SXM4-80GB"), 2.04e12, 300 * GB, 25 * GB, 8),
    # TPU v5p: 95 GB HBM at 2.76 TB/s, ICI 4800 Gb/s per chip in a 3D torus of up to 8960 chips.
    "tpu-v5p": Device("TPU v5p", 95 * GB, *_peaks("TPU v5"), 2.76e12, 300 * GB, 25 * GB, 8960),
    # The host CPU that the tests force into 8 XLA devices: only memory and traffic are meaningful here.
    "cpu": Device("host CPU (XLA:CPU)", 16 * GiB, 1e11, 1e11, 20 * GB, 10 * GB, 10 * GB, 8, usable=1.0,
                  efficiency=0.5, widens_low_precision=True, ragged_exchange=False, low_precision_in_fp32=_old_xla_cpu(),
                  scatter_as_all_reduce=True, sums_apart=True),
}
ALIASES = {"tpuv5p": "tpu-v5p", "v5p": "tpu-v5p", "tpu_v5p": "tpu-v5p", "h100-sxm": "h100", "a100-80gb": "a100"}


def load_device(name: str) -> Device:
    """A built-in device by name (h100, h200, a100, tpu-v5p, cpu) or one from a TOML file.

    The file holds the fields of `Device` at the top level or in a `[device]` table;
    memory and bandwidths may be given in GB (`hbm_gb = 80`, `inter_bandwidth_gb = 50`).
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key in DEVICES:
        return DEVICES[key]
    path = Path(name)
    if path.suffix != ".toml":
        raise ValueError(f"unknown device {name!r}; built in: {', '.join(DEVICES)}, or a .toml file")
    if not path.exists():
        raise ValueError(f"device file {name!r} does not exist")
    table = tomllib.loads(path.read_text())
    table = dict(table.get("device", table))
    for field in ("hbm", "hbm_bandwidth", "intra_bandwidth", "inter_bandwidth", "host_bandwidth"):
        if f"{field}_gb" in table:
            table[field] = float(table.pop(f"{field}_gb")) * GB
    for field in ("peak_flops", "fp32_flops"):
        if f"{field.split('_')[0]}_tflops" in table:
            table[field] = float(table.pop(f"{field.split('_')[0]}_tflops")) * 1e12
    table.setdefault("name", path.stem)
    table.setdefault("fp32_flops", table.get("peak_flops", 0) / 2)
    fields = {f.name for f in dataclasses.fields(Device)}
    unknown = set(table) - fields
    if unknown:
        raise ValueError(f"{name}: unknown device fields {sorted(unknown)}; fields: {sorted(fields)}")
    missing = {f.name for f in dataclasses.fields(Device) if f.default is dataclasses.MISSING} - set(table)
    if missing:
        raise ValueError(f"{name}: missing device fields {sorted(missing)}")
    return Device(**table)


def for_facts(facts: DeviceFacts) -> Device | None:
    """The built-in planner device for a plan's (or a target's) device facts, by device kind; None if none fits."""
    found = device_peak(facts.kind) if facts.backend != "cpu" else ("", "cpu")
    if found is None:
        return None
    by_name = {"H100 SXM": "h100", "H200 SXM": "h200", "A100": "a100", "TPU v5p": "tpu-v5p", "cpu": "cpu"}
    key = by_name.get(found[1])
    if key is None:
        return None
    device = DEVICES[key]
    return dataclasses.replace(device, hbm=float(facts.memory)) if facts.memory and key != "cpu" else device

"""A compile-only target: NVIDIA hosts that a step is compiled for on a machine without them.

XLA compiles for a GPU with no GPU present ("deviceless" ahead-of-time
compilation) from a target config (a text `GpuTargetConfigProto`: the device's
compute capability, memory, cores, links). JAX's CUDA plugin turns one and a
topology string, slices x hosts x devices, into compile-only devices; a plan
on them lowers and compiles as on the real fleet, and its memory and
collectives read back as they would there. Nothing runs.

Names: `h100x8`, `h200x8`, `a100-80x8`, `b200x8` (XLA's own configs, shipped in
`targets/`), `2xh100x8` (two 8-GPU hosts joined by InfiniBand: topology
"2x1x8", each host its own NVLink domain), or the path of a target config file
(dumped from a real fleet; `2x` before it for hosts is not parsed: give
`hosts:path`, e.g. `2:my_fleet.txtpb`). Needs the CUDA plugin (the `gpu-target`
extra) and, without a GPU, `JAX_PLATFORMS=cpu` set before jax starts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
from pathlib import Path

from jaxpar.core import device_facts

SPECS = Path(__file__).parent / "targets"
BUILT_IN = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100-80": "a100_sxm_80.txtpb", "b200": "b200.txtpb"}
PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_NAME = re.compile(r"^(?:(\d+)x)?([a-z0-9\-]+)x(\d+)$")
INSTALL = 'pip install "jaxpar[gpu-target]"'


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed target: its name, the config text, hosts and devices per host."""

    name: str
    config: str
    hosts: int
    per_host: int

    @property
    def topology(self) -> str:
        return f"{self.hosts}x1x{self.per_host}"

    def facts(self) -> device_facts.DeviceFacts:
        """The target's device facts read from its config alone (no plugin: what the planner needs)."""
        kind = re.search(r'device_description_str:\s*"([^"]+)"', self.config)
        memory = re.search(r"device_memory_size:\s*(\d+)", self.config)
        return device_facts.DeviceFacts("gpu", kind.group(1) if kind else "unknown GPU",
                                        int(memory.group(1)) if memory else None, device_facts.GPU_MEMORY_KINDS,
                                        self.hosts, self.hosts * self.per_host, self.name)


def parse(name: str) -> Target:
    """A target by name (see the module doc); ValueError naming what is wrong, before jax is asked anything."""
    text = str(name).strip()
    hosts_prefix = re.match(r"^(\d+):(.+)$", text)
    if hosts_prefix or text.endswith((".txtpb", ".pbtxt", ".textproto")) or os.path.sep in text:
        hosts, path = (int(hosts_prefix.group(1)), hosts_prefix.group(2)) if hosts_prefix else (1, text)
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"target {name!r}: no target config file {path!r} (a text GpuTargetConfigProto)")
        config = file.read_text()
        count = re.search(r"device_count:\s*(\d+)", config)  # not in XLA's specs: one host of 8 by default
        return Target(text, config, hosts, int(count.group(1)) if count else 8)
    match = _NAME.match(text.lower())
    if not match or match.group(2) not in BUILT_IN:
        raise ValueError(f"unknown target {name!r}: give {', '.join(k + 'x8' for k in BUILT_IN)}, HOSTSx<one of "
                         f"those> (e.g. 2xh100x8), or a target config file (.txtpb)")
    hosts, kind, per_host = int(match.group(1) or 1), match.group(2), int(match.group(3))
    if hosts < 1 or per_host < 1:
        raise ValueError(f"target {name!r}: hosts and devices per host must be >= 1")
    return Target(text.lower(), (SPECS / BUILT_IN[kind]).read_text(), hosts, per_host)


def plugin_missing() -> str | None:
    """Why a target cannot compile here (no CUDA plugin), or None."""
    for module in PLUGINS:
        try:
            if importlib.util.find_spec(module) is not None:
                return None
        except ModuleNotFoundError:
            continue
    return f"compiling for a GPU target needs JAX's CUDA plugin, which is not installed: {INSTALL} (no GPU needed)"


CUDNN_INSTALL = "pip install --no-deps nvidia-cudnn-cu12"


def _cudnn_loads() -> bool:
    """Whether jax can load cuDNN here (its cuDNN attention asks the library for its version while lowering)."""
    try:
        from jax._src.lib import cuda_versions  # the check jax.nn.dot_product_attention makes

        return cuda_versions is not None and cuda_versions.cudnn_get_version() > 0
    except Exception:  # noqa: BLE001 - not installed, or not loadable: no cuDNN for this compile
        return False


def devices(name: str) -> tuple:
    """The compile-only devices of target `name` (registered with their facts in jaxpar.core.device_facts)."""
    target = parse(name)
    missing = plugin_missing()
    if missing:
        raise ValueError(missing)
    return _devices(target)


@functools.cache
def _devices(target: Target) -> tuple:
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target.config,
                                                topology=target.topology)
    except Exception as error:  # noqa: BLE001 - the plugin's own message is one line at the end
        last = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ValueError(f"target {target.name!r} does not start ({last}); without a GPU, set JAX_PLATFORMS=cpu "
                         "before jax starts (the CUDA plugin otherwise tries to open a GPU)") from None
    found = tuple(topology.devices)
    facts = dataclasses.replace(target.facts(), backend=found[0].platform, kind=found[0].device_kind,
                                devices=len(found), cudnn=_cudnn_loads())
    device_facts.register_target(found, facts)
    return found


def one_device(name: str) -> tuple:
    """One compile-only device of target `name`'s kind (a one-GPU topology): what a benchmark of one device
    compiles for (benchmarks/attention.py, benchmarks/mfu.py --target)."""
    target = parse(name)
    missing = plugin_missing()
    if missing:
        raise ValueError(missing)
    return _devices(dataclasses.replace(target, name=f"{target.name} (one device)", hosts=1, per_host=1))

"""The XLA flags NVIDIA GPUs train with: communication overlapped with compute, set before the backend starts.

XLA reads `XLA_FLAGS` once, when its backend starts, so `apply` must run
before the first device is touched (the command line calls it first thing; a
user's script calls `jaxpar.gpu_profile.apply()` at its top). It changes
nothing where no NVIDIA GPU is in use, and never overrides a flag the user's
own `XLA_FLAGS` sets. Where each flag comes from and what it does is in the
README's "On GPUs" section; the sources are JAX's GPU performance tips and
NVIDIA JAX-Toolbox's "Tips for high-performance LLMs with JAX and XLA", the
flags MaxText's GPU recipes set.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil

COMBINE_BYTES = 128 * 1024 * 1024  # collectives smaller than this are combined into one launch

FLAGS = {
    # schedule collectives early and compute while they run, instead of in program order
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # combine small collectives of a layer (the per-parameter gathers and reductions) into few large ones
    "xla_gpu_all_reduce_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_all_gather_combine_threshold_bytes": str(COMBINE_BYTES),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(COMBINE_BYTES),
    # in a layer scan, start the next layer's gather (ZeRO-3) and the last layer's reductions one iteration
    # apart, so they overlap the current layer's compute
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # unroll while loops (the layer scan) by two so that the pipelined collectives have a next iteration to overlap
    "xla_gpu_enable_while_loop_double_buffering": "true",
}
PROFILES = ("auto", "none")
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def nvidia_gpu_in_use() -> bool:
    """Whether jax will start on an NVIDIA GPU: a CUDA plugin installed, a driver present, and JAX_PLATFORMS not
    keeping jax off it. Decided without starting the backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    driver = os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None
    return driver and any(_installed(name) for name in CUDA_PLUGINS)


def apply(profile: str = "auto", environ=os.environ) -> dict[str, str]:
    """Add the GPU profile's flags to `XLA_FLAGS` (profile `auto`: on an NVIDIA GPU; `none`: never); return the
    flags added. A flag already in `XLA_FLAGS` keeps the user's value."""
    if profile not in PROFILES:
        raise ValueError(f"--gpu-flags must be one of {PROFILES}, got {profile!r}")
    if profile == "none" or not nvidia_gpu_in_use():
        return {}
    return add_flags(FLAGS, environ)


# A compile-only target has no GPU for XLA's CUB radix sort to size its scratch space on: a sort of 32,768 rows or
# more (a MoE layer's dispatch) fails with "cudaErrorInvalidDevice". XLA's own sort needs no device.
DEVICELESS = {"xla_gpu_enable_cub_radix_sort": "false"}


def compile_options(facts, profile: str = "auto", environ=os.environ) -> dict[str, bool | int | str]:
    """The profile's flags as compile options for a compile-only NVIDIA target (`facts`: the plan's
    jaxpar.core.device_facts), where XLA_FLAGS set for this process's own backend would not reach it, with what
    a compile without a device needs (`DEVICELESS`, whatever the profile); a flag the user's XLA_FLAGS sets is
    left to it. Empty for the process's own devices (`apply` set XLA_FLAGS there)."""
    if profile not in PROFILES:
        raise ValueError(f"--gpu-flags must be one of {PROFILES}, got {profile!r}")
    if not facts.target or not facts.nvidia:
        return {}
    named = {f.lstrip("-").split("=", 1)[0] for f in environ.get("XLA_FLAGS", "").split()}
    typed = lambda v: v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v  # noqa: E731
    flags = DEVICELESS if profile == "none" else {**FLAGS, **DEVICELESS}
    return {name: typed(value) for name, value in flags.items() if name not in named}


def compile_with(lowered, options: dict) -> tuple[object, dict, list[str]]:
    """(compiled, the options it took, the options it refused) for `lowered.compile(options)`: a flag this XLA
    does not take as a compile option ("No such compile option": on jax 0.12.0.1 the three pipelined-collective
    flags) is left out and named, not fatal."""
    options, unknown = dict(options), []
    while True:
        try:
            return lowered.compile(options or None), options, unknown
        except Exception as error:  # noqa: BLE001 - jax's JaxRuntimeError; anything else is raised again below
            name = re.search(r"No such compile option: '([\w.]+)'", str(error))
            if not name or name.group(1) not in options:
                raise
            unknown.append(name.group(1))
            del options[name.group(1)]


def add_flags(flags: dict[str, str], environ=os.environ) -> dict[str, str]:
    """Append `flags` to XLA_FLAGS, leaving out those the user already set; return those added."""
    current = environ.get("XLA_FLAGS", "").split()
    named = {f.lstrip("-").split("=", 1)[0] for f in current}
    added = {name: value for name, value in flags.items() if name not in named}
    environ["XLA_FLAGS"] = " ".join(current + [f"--{name}={value}" for name, value in added.items()])
    return added

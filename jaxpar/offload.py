"""ZeRO-Offload: the optimizer state lives in host memory between steps and visits the device for its update.

Adam's two moments, and the fp32 master copy under mixed precision, are two to
three times the parameter bytes, yet each step touches them once, in the
update. Keeping them in host memory (JAX memory kinds) frees that much device
memory for one host-to-device and one device-to-host copy of them per step.
The shardings do not change, only the memory they name: ZeRO still splits the
state over `data`, so each process moves its own shard only.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

TARGETS = ("none", "optimizer")
HOST = "pinned_host"  # page-locked host memory: the device copies it by DMA
DEVICE = "device"


def check(target: str, mesh: Mesh) -> None:
    """Raise ValueError when `target` is unknown or the mesh's devices have no pinned host memory."""
    if target not in TARGETS:
        raise ValueError(f"offload must be one of {TARGETS}, got {target!r}")
    if target == "none":
        return
    device = mesh.devices.flat[0]
    kinds = [memory.kind for memory in device.addressable_memories()]
    if HOST not in kinds:
        raise ValueError(f"offload={target!r} needs {HOST!r} memory, but {device.platform} devices have "
                         f"{', '.join(kinds)}; use offload='none' on this backend")


def on_host(shardings):
    """The same shardings in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings, is_leaf=_is_sharding)


def to_device(tree, shardings):
    """`tree`, resident in host memory, copied to device memory in its own layout (in a jitted step or eagerly)."""
    return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings, is_leaf=_is_sharding))


def in_host_memory(x) -> bool:
    """Whether a concrete array lives in host memory."""
    return isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) == HOST


def _is_sharding(x) -> bool:
    return isinstance(x, NamedSharding)

"""ZeRO-Offload: the optimizer state lives in host memory between steps and visits the device for its update.

Adam's two moments, and the fp32 master parameters under mixed precision
(jaxpar.train.precision: the state's parameters themselves, cast to 2 bytes at
use), are two to three times the parameter bytes, yet a step needs them only
around its update. Keeping them in host memory (JAX memory kinds) frees that
much device memory between steps for one host-to-device and one
device-to-host copy of them per step.
The shardings do not change, only the memory they name: ZeRO still splits the
state over its axes (`data`; under HSDP a copy per `replica`), so each process
moves its own shard only.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar.core import device_facts, options

TARGETS = ("none", "optimizer")
HOST = "pinned_host"  # page-locked host memory: the device copies it by DMA
DEVICE = "device"


def check(target: str, mesh: Mesh) -> None:
    """Raise ValueError when `target` is unknown or the mesh's devices have no pinned host memory."""
    if target not in TARGETS:
        raise ValueError(f"offload must be one of {TARGETS}, got {target!r}")
    if target == "none":
        return
    facts = device_facts.of_mesh(mesh)  # a compile-only target's devices list none: the target says
    kinds = facts.memory_kinds
    if HOST not in kinds:
        raise ValueError(f"offload={target!r} needs {HOST!r} memory, but {facts.backend} devices have "
                         f"{', '.join(kinds)}; use offload='none' on this backend")
    if facts.target:  # JAX canonicalises a memory kind on devices that list no memories to None: no host placement
        raise ValueError(f"offload={target!r} cannot be compiled for target {facts.target!r}: JAX gives a "
                         f"compile-only device no memory spaces, so the step would keep its optimizer state on the "
                         f"device; the planner's figure for it (jaxpar plan) is the planner's alone, compile it on "
                         f"the real hosts")


options.register_plan_check(lambda plan: check(plan.offload, plan.mesh))


def on_host(shardings):
    """The same shardings in host memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings, is_leaf=_is_sharding)


def to_device(tree, shardings):
    """`tree`, resident in host memory, copied to device memory in its own layout (in a jitted step or eagerly)."""
    return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings, is_leaf=_is_sharding))


def fetched(tree):
    """`tree` with its arrays in host memory copied to device memory: for work outside the step (evaluation)."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(DEVICE)) if in_host_memory(x) else x,
                        tree)


def moved(shardings) -> bool:
    """Whether any leaf of a tree of shardings names host memory."""
    return any(s.memory_kind == HOST for s in jax.tree.leaves(shardings, is_leaf=_is_sharding))


def in_host_memory(x) -> bool:
    """Whether a concrete array lives in host memory."""
    return isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) == HOST


def _is_sharding(x) -> bool:
    return isinstance(x, NamedSharding)

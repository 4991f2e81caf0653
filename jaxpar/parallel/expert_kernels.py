"""Which form a dropless MoE layer's experts run in, and why (`Plan.moe_kernel`).

`buffered`: every expert gets a [group, d] buffer of slots (room for the whole
routing group), the experts' matmuls batched over them: memory and FLOPs of
experts x tokens. `tiled`: the assignments sorted by expert and each
expert's rows run a tile at a time (`jaxpar.parallel.expert_dispatch.tiled_ffn`):
memory of the routed rows, on any backend. `ragged`: the sorted rows through
`jax.lax.ragged_dot`, the grouped matmul XLA lowers natively on TPU; XLA:CPU
expands it into a dense dot over every expert, more memory than `buffered`.
On a GPU `auto` compiles one small `ragged_dot` for the plan's devices and takes
`ragged` where XLA kept it a grouped matmul (jax 0.12's XLA:GPU for h100x8 does
not: it expands it as XLA:CPU does), `tiled` elsewhere.
A capacity-routed layer is always `buffered`: forcing a sorted form on one is
refused. Each layer's choice is marked in the trace (`jaxpar.core.usage`).
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.core import device_facts, options, usage
from jaxpar.core.trace import active_plan

KERNELS = ("auto", "buffered", "tiled", "ragged")
options.register_choices("moe_kernel", KERNELS)
EXCHANGE_MARK = "moe exchange: "  # jaxpar.parallel.expert_exchange's marks, read back by `choices`
MARK = "moe kernel: "  # the prefix of the usage marks that record each MoE layer's choice
NATIVE_RAGGED_DOT = ("tpu",)  # the platforms whose XLA lowers ragged_dot to a grouped matmul, not a dense dot


def platform(plan) -> str:
    """The plan's backend ("cpu", "gpu", "tpu") from its devices' facts (a GPU target's too); "cpu" outside a plan."""
    return "cpu" if plan is None else device_facts.of_mesh(plan.mesh).backend


def native_ragged_dot(plan) -> bool:
    """Whether XLA keeps `jax.lax.ragged_dot` a grouped matmul on the plan's devices: known for TPU (yes) and CPU
    (no); on a GPU found by compiling one small ragged_dot there (`_grouped_after_compile`, once per kind)."""
    backend = platform(plan)
    if backend in NATIVE_RAGGED_DOT or backend == "cpu":
        return backend in NATIVE_RAGGED_DOT
    facts = device_facts.of_mesh(plan.mesh)
    key = (facts.backend, facts.kind, facts.target)
    if key not in _GROUPED:
        _GROUPED[key] = _grouped_after_compile(plan.mesh)
    return _GROUPED[key]


_GROUPED: dict[tuple[str, str, str], bool] = {}  # (backend, kind, target) -> whether XLA kept ragged_dot grouped


def _grouped_after_compile(mesh) -> bool:
    """Whether a ragged_dot compiled for `mesh`'s devices is still one (a grouped matmul, maybe in a fusion) after
    XLA's passes. Compiled on a thread of its own: a layer asks while its step is being traced."""

    def compile_one() -> bool:
        replicated = NamedSharding(mesh, PartitionSpec())
        lhs, rhs = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((4, 32, 16), jnp.bfloat16)
        groups = jax.ShapeDtypeStruct((4,), jnp.int32)
        fn = jax.jit(jax.lax.ragged_dot, in_shardings=(replicated,) * 3, out_shardings=replicated)
        return "ragged-dot(" in fn.lower(lhs, rhs, groups).compile().as_text()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(compile_one).result()


def choose(dropless: bool, plan=None) -> tuple[str, str]:
    """(kernel, why) for an MoE layer under `plan` (the active plan by default); a forced sorted kernel on a
    capacity-routed layer raises ValueError."""
    plan = plan if plan is not None else active_plan()
    asked = "auto" if plan is None else plan.moe_kernel
    if not dropless:
        if asked in ("tiled", "ragged"):
            raise ValueError(f"moe_kernel={asked!r} runs dropless routing, but this MoE layer routes with a capacity "
                             "factor (dropless=False): use moe_kernel='auto' or 'buffered', or a dropless model")
        return "buffered", "capacity routing: [experts, capacity, d] slots per group"
    xla = f"XLA:{platform(plan).upper()}"
    if asked != "auto":
        note = "" if asked != "ragged" or native_ragged_dot(plan) else \
            f"; {xla} expands ragged_dot into a dense dot over every expert"
        return asked, f"asked for (moe_kernel={asked}){note}"
    if native_ragged_dot(plan):
        return "ragged", f"auto: dropless, {xla} lowers ragged_dot to a grouped matmul"
    return "tiled", f"auto: dropless, no native grouped matmul on {xla} (ragged_dot would " \
                    "expand into a dense dot): each expert's sorted rows a tile at a time"


def check_model(n_experts: int, dropless: bool, plan, name: str) -> None:
    """A forced `moe_kernel` the model cannot take, refused before anything compiles: on a model without experts,
    or a sorted kernel on a capacity-routed one."""
    if plan.moe_kernel == "auto":
        return
    if not n_experts:
        raise ValueError(f"moe_kernel={plan.moe_kernel!r} but {name} has no MoE layers: drop --moe-kernel")
    choose(dropless, plan)


def chosen(dropless: bool) -> str:
    """The kernel for a layer under the active plan, its choice marked in the trace."""
    return usage.mark_choice(MARK, *choose(dropless))


def choices(used: set[str]) -> list[str]:
    """Every distinct MoE kernel choice marked while a step was traced, then each exchange over `expert` chosen
    (`jaxpar.parallel.expert_exchange`), as "exchange NAME (why)"."""
    return usage.marked_choices(used, MARK) + ["exchange " + c for c in usage.marked_choices(used, EXCHANGE_MARK)]

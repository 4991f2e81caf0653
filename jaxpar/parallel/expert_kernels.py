"""Which form a dropless MoE layer's experts run in, and why (`Plan.moe_kernel`).

`buffered`: every expert gets a [group, d] buffer of slots (room for the whole
routing group), the experts' matmuls batched over them: memory and FLOPs of
experts x tokens. `tiled`: the assignments sorted by expert and each
expert's rows run a tile at a time (`jaxpar.parallel.expert_dispatch.tiled_ffn`):
memory of the routed rows, on any backend. `ragged`: the sorted rows through
`jax.lax.ragged_dot`, the grouped matmul XLA lowers natively on TPU; XLA:CPU
(and XLA:GPU by default) expand it into a dense dot over every expert, more
memory than `buffered`, so `auto` takes it on TPU only and `tiled` elsewhere.
A capacity-routed layer is always `buffered`: forcing a sorted form on one is
refused. Each layer's choice is marked in the trace (`jaxpar.core.usage`).
"""

from __future__ import annotations

from jaxpar.core import device_facts, options, usage
from jaxpar.core.trace import active_plan

KERNELS = ("auto", "buffered", "tiled", "ragged")
options.register_choices("moe_kernel", KERNELS)
MARK = "moe kernel: "  # the prefix of the usage marks that record each MoE layer's choice
NATIVE_RAGGED_DOT = ("tpu",)  # the platforms whose XLA lowers ragged_dot to a grouped matmul, not a dense dot


def platform(plan) -> str:
    """The plan's backend ("cpu", "gpu", "tpu") from its devices' facts (a GPU target's too); "cpu" outside a plan."""
    return "cpu" if plan is None else device_facts.of_mesh(plan.mesh).backend


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
    if asked != "auto":
        note = "" if asked != "ragged" or platform(plan) in NATIVE_RAGGED_DOT else \
            f"; XLA:{platform(plan).upper()} expands ragged_dot into a dense dot over every expert"
        return asked, f"asked for (moe_kernel={asked}){note}"
    if platform(plan) in NATIVE_RAGGED_DOT:
        return "ragged", f"auto: dropless, XLA:{platform(plan).upper()} lowers ragged_dot to a grouped matmul"
    return "tiled", f"auto: dropless, no native grouped matmul on XLA:{platform(plan).upper()} (ragged_dot would " \
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
    """Every distinct MoE kernel choice marked while a step was traced."""
    return usage.marked_choices(used, MARK)

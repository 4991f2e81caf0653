"""What one's own compiled step does: its collectives, memory and FLOPs, as `jaxpar inspect` reads the built-in
models' (a stable public name).

    import jaxpar.inspect

    step = jaxpar.make_train_step(model, loss_fn, optimizer, plan)
    state = jaxpar.inspect.abstract_state(model, optimizer, plan)   # shapes only: nothing is allocated
    report = jaxpar.inspect.inspect_step(step, state, batch)
    jaxpar.inspect.show(report)                                     # the tables `jaxpar inspect` prints

`report` is the JSON `jaxpar inspect --json` prints, less the model's name: `collectives` (per device per step,
one row per kind and mesh axes: `count` (calls), `buffers`, `bytes` and ring `traffic`, loops' trip counts multiplied in),
`memory` (XLA's per-device arguments, outputs, temp, total), `flops` (XLA's cost analysis) and `matmul_flops`
(every dot counted as often as it runs), `process_axes` (the mesh axes crossing hosts), `pipeline` (bubble,
residual ring) under `pipe` > 1, and `attention` (the implementation each attention call got) for a jaxpar step.
`summary(compiled, mesh)` reads any compiled jax function the same way.

For NVIDIA hosts this machine lacks, build the plan on a compile-only target (no GPU needed, the CUDA plugin
installed, JAX_PLATFORMS=cpu): `plan = jaxpar.Plan.create("data=4,tensor=2", target="h100x8", precision="bf16")`;
the same calls then compile for H100s, with the GPU profile's XLA flags as compile options, and the report
adds `target`, `device_kind` and `gpu_flags`.
"""

from __future__ import annotations

import jax
from rich.console import Console

from jaxpar.core import device_facts, gpu_profile
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention_kernels
from jaxpar.planner.inspect import collectives, flops, matmul_flops, memory, summary
from jaxpar.run.report import show_compiled
from jaxpar.train.state import abstract_state

__all__ = ["abstract_state", "collectives", "flops", "inspect_step", "matmul_flops", "memory", "show", "summary"]


def inspect_step(step, *args, plan: Plan | None = None, mesh: jax.sharding.Mesh | None = None) -> dict:
    """Compile `step(*args)` and read it back (see the module docstring); nothing runs.

    `step`: `jaxpar.make_train_step`'s (its plan is known), or any `jax.jit` function with `plan` or `mesh`
    given. `args` may be arrays or `jax.ShapeDtypeStruct`s with shardings (`abstract_state`)."""
    plan = plan or getattr(step, "plan", None)
    mesh = mesh or (plan.mesh if plan is not None else None)
    if mesh is None:
        raise ValueError("inspect_step needs the mesh the step runs on: pass plan= or mesh= (a jaxpar step knows it)")
    facts = device_facts.of_mesh(mesh)
    compiled, flags, unknown = gpu_profile.compile_with(step.lower(*args), gpu_profile.compile_options(facts))
    report = summary(compiled, mesh, plan)
    if facts.target:
        report.update(target=facts.target, device_kind=facts.kind,
                      gpu_flags={"applied": sorted(flags), "not_compile_options": unknown})
    if hasattr(step, "used"):  # traced by the lowering above
        report["attention"] = attention_kernels.choices(step.used)
    return report


def show(report: dict, console: Console | None = None) -> None:
    """Print `report` as the tables `jaxpar inspect` prints: collectives, memory, FLOPs, attention, pipeline."""
    show_compiled(report, console or Console())

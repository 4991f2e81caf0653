"""jaxpar's compiled train step on MaxText's tiny llama2 (issue 16): memory and HLO op counts per layout.

Compiled memory is deterministic, so it is measured exactly here, whatever the
load on the machine. For each layout of `peers/jaxpar/paired.sh` this compiles
one step on abstract inputs (as `jaxpar inspect` does) and prints one JSON row:
memory_analysis (arguments, outputs, alias, temp, total), the HLO instructions
by kind (count and result bytes, instructions inside loops counted once per
textual occurrence), and the collectives.

    env -u XLA_FLAGS python benchmarks/vs_maxtext.py [dp8 fsdp8 ...] [--dump DIR] [--guard]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext-model.toml")  # the paired model
LAYOUTS = {
    "dp8": ["--mesh", "data=8"],
    "fsdp8": ["--mesh", "data=8", "--zero", "3"],
    "dp2_tp4": ["--mesh", "data=2,tensor=4"],
    "pp2_dp4": ["--mesh", "data=4,pipe=2", "--microbatches", "4"],
    "pp4_dp2": ["--mesh", "data=2,pipe=4", "--microbatches", "4"],
}
# MaxText 0.2.5, peers/maxtext/README.md (REPEATS=2 STEPS=20, 2026-11-29): compiled MB/device, of which arguments.
MAXTEXT_MB = {"dp8": (411.2, 247.0), "fsdp8": (136.8, 30.9), "dp2_tp4": (162.3, 61.8),
              "pp2_dp4": (362.9, 221.8), "pp4_dp2": (344.5, 209.2)}

KINDS = ("fusion", "copy", "transpose", "convert", "dot", "convolution", "all-reduce", "all-gather",
         "reduce-scatter", "all-to-all", "collective-permute", "dynamic-slice", "dynamic-update-slice", "while",
         "conditional", "select", "broadcast")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z\-]+)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|c64|c128)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def op_counts(text: str) -> dict[str, dict[str, int]]:
    """Instructions of the optimized HLO (fused computations excluded) by opcode: count and result bytes."""
    out = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    fused = False
    for line in text.splitlines():
        if line and not line.startswith(" "):  # a computation header
            fused = line.lstrip("%").startswith(("fused_", "%fused")) or "fused_computation" in line.split("(")[0]
            continue
        if fused:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        kind = m.group(2)
        nbytes = 0
        for dtype, dims in _ARRAY.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n * _BYTES.get(dtype, 4)
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
    return dict(out)


def aliased_outputs(text: str) -> int:
    """How many output/input alias pairs the module declares (its input_output_alias)."""
    m = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*(?:entry_computation_layout|allow|alias_passthrough|$)", text)
    return 0 if not m else m.group(1).count("may-alias") + m.group(1).count("must-alias")


def unguarded_temp(run, state, batch) -> int:
    """Temp bytes of the same step without its NaN guard (a plain jit of the update, state donated)."""
    import jax

    from jaxpar.planner import inspect as inspect_lib
    from jaxpar.train import precision
    from jaxpar.train.state import TrainState, state_specs
    from jaxpar.train.step import loss_and_grads

    plan, model = run.plan, run.model
    wrapped = precision.wrap(run.optimizer, plan.precision)

    def step(state, batch):
        loss, _, grads, variables = loss_and_grads(model, lambda m, b: m(b), state.params, batch, plan, None,
                                                   state.variables, state.step)
        params, opt_state, _ = wrapped.apply(grads, state.opt_state, state.params)
        params = jax.lax.with_sharding_constraint(params, plan.shardings(plan.gradient_specs(model.logical)))
        return TrainState(params, opt_state, state.step + 1, variables), loss

    shardings = plan.shardings(state_specs(model, wrapped, plan))
    plain = jax.jit(step, in_shardings=(shardings, run.batch_sharding), out_shardings=(shardings, None),
                    donate_argnums=0)
    with plan.activate():
        return inspect_lib.memory(plain.lower(state, batch).compile())["temp"]


def measure(name: str, dump: str | None = None, guard: bool = False) -> dict:
    from jaxpar import cli
    from jaxpar.planner import inspect as inspect_lib
    from jaxpar.core.plan import Plan
    from jaxpar.run.report import inspection
    from jaxpar.train.state import abstract_state
    from jaxpar.run.training import prepare
    import jax

    args = cli.build_parser().parse_args(["inspect", "--config", CONFIG, *LAYOUTS[name], "--json"])
    config, options, mesh = cli.resolve(args)
    plan = Plan.create(mesh, **options)
    run = prepare(config, plan)
    state = abstract_state(run.model, run.optimizer, run.plan)
    shape = (run.config.batch_size, run.config.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=run.batch_sharding)
             for k in ("inputs", "targets")}
    compiled = run.step_fn.lower(state, batch).compile()
    text = compiled.as_text()
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{name}.hlo.txt"), "w") as f:
            f.write(text)
    mem = inspect_lib.memory(compiled)
    ops = op_counts(text)
    state_leaves = len(jax.tree.leaves(state))
    mt_total, mt_args = MAXTEXT_MB[name]
    guard_cost = {"guard_temp_mb": round((mem["temp"] - unguarded_temp(run, state, batch)) / 1e6, 1)} if guard else {}
    return {
        "layout": name, "jax": jax.__version__, **guard_cost,
        "memory_mb": {k: round(v / 1e6, 1) for k, v in mem.items()},
        "maxtext_mb": {"total": mt_total, "arguments": mt_args},
        "memory_ratio": round(mem["total"] / 1e6 / mt_total, 3),
        "state_leaves": state_leaves, "aliased": aliased_outputs(text),
        "ops": {k: ops[k] for k in KINDS if k in ops},
        "collectives": inspect_lib.collectives(compiled, run.plan.mesh),
        "params": run.model.param_count(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--dump", default=None, help="write each compiled step's HLO text here")
    parser.add_argument("--guard", action="store_true", help="also compile the step without its NaN guard: "
                        "guard_temp_mb is what the guard adds to temp")
    args = parser.parse_args()
    from jaxpar import cli

    cli._set_host_devices(8)
    for name in args.layouts:
        print(json.dumps(measure(name, args.dump, args.guard)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

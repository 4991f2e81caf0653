"""HSDP figures as JSON: the compiled step's traffic per mesh axis against the formula, ZeRO-1/2/3.

    python benchmarks/hsdp.py [--model tiny] [--replica 2] [--data 4]

HSDP shards within `data` (one host) and replicates over `replica` (across hosts). Per device
and step, with Psi the gradient bytes ZeRO shards (fp32) and L the stacked layers' share:
over data a reduce-scatter of Psi and an all-gather of Psi (ZeRO-3: Psi + L, the layers
gathered again for the backward pass); over replica one all-reduce of the shard, Psi/data.
Traffic is what a device sends under a ring: (n-1)/n of the bytes for reduce-scatter and
all-gather, 2(n-1)/n for all-reduce. The full-ZeRO row (zero_axes=replica,data) shows what
crossing hosts costs without HSDP: every gather and reduce-scatter spans them.
"""

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.planner import inspect  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.run.training import TrainConfig, prepare  # noqa: E402


def measure(args, **options) -> tuple:
    """Compile one step of `options` on the replica x data mesh: (plan, model, collective rows)."""
    plan = Plan.create(f"replica={args.replica},data={args.data}", **options)
    run = prepare(TrainConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, steps=1), plan)
    state = run.init()
    compiled = run.step_fn.lower(state, run.batch(0)).compile()
    return plan, run.model, inspect.collectives(compiled, plan.mesh)


def per_axis(rows) -> dict:
    """{axes: {kind: {bytes, traffic, count}}}, the scalar all-reduces (< 1 KiB: loss, gradient norms) left out."""
    out: dict = {}
    for r in rows:
        if r["kind"] == "all-reduce" and r["bytes"] < 1024:
            continue
        out.setdefault(",".join(r["axes"]), {})[r["kind"]] = {k: r[k] for k in ("bytes", "traffic", "count")}
    return out


def formula(plan, model) -> dict:
    """The HSDP per-axis bytes and traffic this plan's stage promises (see the module doc)."""
    report = plan.zero_report(model.logical)
    psi = report.total_bytes - report.replicated_bytes
    layers = sum(leaf.nbytes for leaf in jax.tree.leaves(model.logical) if leaf.names[0] == "layers")
    d, r = plan.shape["data"], plan.shape["replica"]
    gathered = psi + layers if plan.zero == 3 else psi
    return {
        "data": {"reduce-scatter": {"bytes": psi, "traffic": (d - 1) / d * psi},
                 "all-gather": {"bytes": gathered, "traffic": (d - 1) / d * gathered}},
        "replica": {"all-reduce": {"bytes": psi // d, "traffic": 2 * (r - 1) / r * (psi // d)}},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replica", type=int, default=2)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    stages = []
    for zero in (1, 2, 3):
        plan, model, rows = measure(args, zero=zero)
        measured, expected = per_axis(rows), formula(plan, model)
        ratios = {f"{axes}/{kind}": measured.get(axes, {}).get(kind, {}).get("bytes", 0) / want["bytes"]
                  for axes, kinds in expected.items() for kind, want in kinds.items()}
        stages.append({"zero": zero, "measured": measured, "formula": expected, "measured_over_formula": ratios,
                       "replicated_bytes": plan.zero_report(model.logical).replicated_bytes})
    _, _, full = measure(args, zero=3, zero_axes=("replica", "data"))
    print(json.dumps({
        "benchmark": "hsdp",
        "model": args.model,
        "mesh": {"replica": args.replica, "data": args.data},
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "stages": stages,
        "full_zero3_over_replica_and_data": per_axis(full),
    }, indent=1))


if __name__ == "__main__":
    main()

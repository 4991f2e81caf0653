"""The planner's memory per device against the GPU compiler's, for the built-in 1B and 8B on an H100 host (issue 54).

For each model, sequence length and layout: the step compiled for the target
(`jaxpar plan --target --verify`'s compile: jaxpar.run.verify, deviceless, the
CUDA plugin and JAX_PLATFORMS=cpu, no GPU) and the planner's figure for the
same layout; bytes per device (arguments and temporaries apart, and their
total), the ratio planner / compiled, the attention kernel chosen, whether it
fits. One JSON line per row as it compiles (the compiles are slow: minutes on
a small CPU), then a markdown table of every row.

    JAX_PLATFORMS=cpu python benchmarks/gpu_memory.py                        # 1b and qwen3-8b, seq 4096 and 8192
    JAX_PLATFORMS=cpu python benchmarks/gpu_memory.py --models 1b --seqs 4096 --batch 16
    python benchmarks/gpu_memory.py --replan rows.jsonl    # an earlier run's compiled rows, the planner's again
"""

from __future__ import annotations

import argparse
import json
import time

from jaxpar.core.target import parse
from jaxpar.planner.devices import for_facts
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.model import Model

LAYOUTS = ("data=8 zero=3", "data=4,tensor=2 zero=1", "data=2,pipe=4 schedule=1f1b microbatches=8",
           "data=2,tensor=2,pipe=2")


def planned(model_name: str, seq: int, spec: str, batch: int, target: str, precision: str):
    """The planner's estimate of one row, on the target's device."""
    layout = Layout.parse(f"{spec} precision={precision}")
    device = for_facts(parse(target).facts())
    return layout, device, estimate(Model.named(model_name, {"seq_len": seq}), layout, Workload(batch, seq), device)


def replanned(old: dict, precision: str) -> dict:
    """A row of an earlier run (its compiled figures) with the planner's side computed again: no compile."""
    _, _, est = planned(old["model"], old["seq"], old["layout"], old["batch"], old["target"], precision)
    return {**old, "planner": {k: est.memory[k] for k in ("arguments", "temp_total", "total")},
            "ratio": est.memory["total"] / old["compiled"]["total"]}


def row(model_name: str, seq: int, spec: str, batch: int, target: str, precision: str) -> dict:
    """One layout compiled for `target` beside the planner's estimate of it."""
    from jaxpar.core.plan import Plan
    from jaxpar.run.report import inspection
    from jaxpar.run.training import TrainConfig, prepare

    layout, device, est = planned(model_name, seq, spec, batch, target, precision)
    began = time.perf_counter()
    plan = Plan.create(layout.mesh, target=target, **layout.options())
    report = inspection(prepare(TrainConfig(model=model_name, batch_size=batch, seq_len=seq), plan))
    compiled = report["memory"]
    return {"model": model_name, "seq": seq, "batch": batch, "layout": spec, "target": target,
            "compile_s": round(time.perf_counter() - began, 1),
            "planner": {k: est.memory[k] for k in ("arguments", "temp_total", "total")},
            "compiled": {k: compiled[k] for k in ("arguments", "temp", "total")},
            "ratio": est.memory["total"] / compiled["total"], "attention": report["attention"],
            "fits": compiled["total"] <= device.capacity}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | seq | layout | compiled GB/device | planner GB/device | planner / compiled | attention "
             "| fits |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernel = ", ".join(a.split(" ")[0] for a in r["attention"])
        lines.append(f"| {r['model']} | {r['seq']} | `{r['layout']}` | {r['compiled']['total'] / 1e9:.2f} | "
                     f"{r['planner']['total'] / 1e9:.2f} | {r['ratio']:.3f} | {kernel} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,qwen3-8b")
    parser.add_argument("--seqs", default="4096,8192")
    parser.add_argument("--layouts", default=";".join(LAYOUTS), help="layouts separated by ';'")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target", default="h100x8")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--replan", default=None, metavar="JSONL", help="no compile: the rows of an earlier run's "
                                                                         "output, the planner's side computed again")
    args = parser.parse_args()
    if args.replan:
        with open(args.replan) as f:
            rows = [replanned(json.loads(line), args.precision) for line in f if line.startswith("{")]
        print(markdown(rows))
        return
    rows = []
    for model in args.models.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            for spec in args.layouts.split(";"):
                rows.append(row(model, seq, spec.strip(), args.batch, args.target, args.precision))
                print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()

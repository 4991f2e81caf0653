"""The planner against the compiler: prediction / compiled ratio of every cell of a layout sweep, as JSON.

    python benchmarks/planner.py [--model tiny] [--batch-size 16] [--seq-len 32] [--quick] [--shapes 7b,70b]

Each cell is compiled abstractly (`jaxpar inspect`: no parameters allocated, nothing trained) on 8
CPU devices; the planner predicts the same cell with the `cpu` device spec. Ratios are given for
argument bytes, temp bytes and ring traffic per mesh axis (tests/test_planner.py holds a smaller
grid to 10% / 25% / 10%), one JSON line per cell, then the worst ratio per quantity. `--shapes`
also checks the big models' layouts (abstract compiles of the 7B/70B/405B shapes on 8 devices:
slower, but no memory is used).
"""

import argparse
import itertools
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.planner.compare import compiled_figures, predicted_figures, ratios  # noqa: E402
from jaxpar.planner.estimate import estimate  # noqa: E402
from jaxpar.planner.layout import Layout, Workload  # noqa: E402
from jaxpar.planner.model import Model  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.run.report import inspection  # noqa: E402
from jaxpar.run.training import TrainConfig, prepare  # noqa: E402


def sweep(quick: bool) -> list[tuple[str, dict, str]]:
    """Layouts of 8 devices: every ZeRO stage x remat x precision on data, then tensor, pipe, expert, context
    and HSDP meshes."""
    cells = []
    for zero, remat in itertools.product(range(4), ("none", "selective", "full")):
        cells.append(("data=8", {"zero": zero, "remat": remat}, "tiny"))
    for zero, precision in itertools.product(range(4), ("bf16", "bf16-params")):
        cells.append(("data=8", {"zero": zero, "precision": precision}, "tiny"))
    for zero in range(4):
        cells.append(("data=8", {"zero": zero, "grad_accum": 2}, "tiny"))
    for mesh in ("tensor=8", "data=4,tensor=2", "data=2,tensor=4"):
        for options in ({}, {"zero": 1, "remat": "selective"}, {"sequence_parallel": True, "tensor_form": "explicit"}):
            cells.append((mesh, options, "tiny"))
    for mesh, schedule, extra in (("data=4,pipe=2", "gpipe", {}), ("data=4,pipe=2", "1f1b", {}),
                                  ("data=4,pipe=2", "interleaved", {"virtual_stages": 2}),
                                  ("data=2,pipe=4", "1f1b", {}), ("data=2,tensor=2,pipe=2", "1f1b", {"zero": 1}),
                                  ("data=2,tensor=2,pipe=2", "gpipe", {"remat": "full"}),
                                  ("data=4,pipe=2", "zb-h1", {}), ("data=2,pipe=4", "zb-h1", {"zero": 3}),
                                  ("data=2,tensor=2,pipe=2", "zb-h1", {"zero": 1, "remat": "full"})):
        for m in (4, 8):
            cells.append((mesh, {"schedule": schedule, "microbatches": m, **extra}, "tiny"))
    for mesh in ("data=2,expert=4", "expert=8", "data=4,expert=2", "data=2,expert=2,tensor=2"):
        cells.append((mesh, {}, "moe-tiny"))
        cells.append((mesh, {"zero": 1}, "moe-tiny"))
    for mesh, options in (("data=2,context=4", {}), ("data=2,context=4", {"context_form": "ring"}),
                          ("data=4,context=2", {"zero": 3}), ("data=2,context=2,tensor=2", {"tensor_form": "explicit"})):
        cells.append((mesh, options, "tiny"))
    for zero in (1, 2, 3):
        cells.append(("replica=2,data=4", {"zero": zero}, "tiny"))
    return cells[::4] if quick else cells


def measure(mesh: str, options: dict, model: str, batch: int, seq: int) -> dict:
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    layout = Layout(**sizes, **{"precision": "fp32", **options})
    work = Workload(batch, seq)
    est = estimate(Model.named(model, {"seq_len": seq}), layout, work, "cpu")
    row = {"model": model, "mesh": mesh, "options": options}
    if "arguments" not in est.memory:  # the layout cannot run the model (not fitting the CPU is no matter)
        return {**row, "skipped": est.reason}
    began = time.perf_counter()
    try:
        run = prepare(TrainConfig(model=model, batch_size=batch, seq_len=seq), Plan.create(mesh, **options))
        summary = inspection(run)
    except ValueError as error:
        return {**row, "skipped": str(error)}
    return {**row, "compile_s": time.perf_counter() - began, "ratios": ratios(est, summary),
            "predicted": predicted_figures(est), "compiled": compiled_figures(summary)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="every fourth cell")
    parser.add_argument("--shapes", default="", help="also big shapes, e.g. 7b,70b (abstract compiles, slow)")
    args = parser.parse_args()
    cells = [(mesh, options, model, args.batch_size, args.seq_len) for mesh, options, model in sweep(args.quick)]
    for name in filter(None, args.shapes.split(",")):
        for mesh, options in (("data=2,tensor=4", {"zero": 1, "remat": "full", "precision": "bf16"}),
                              ("data=2,tensor=2,pipe=2", {"zero": 1, "remat": "full", "precision": "bf16"}),
                              ("data=2,tensor=4", {"zero": 3, "remat": "full", "precision": "bf16"})):
            cells.append((mesh, options, name, 2, 2048))
    rows = []
    for cell in cells:  # one JSON line per cell as it compiles, then the summary
        rows.append(measure(*cell))
        print(json.dumps({"cell": rows[-1]}, default=float), flush=True)
    worst = {}
    for row in rows:
        for key, ratio in row.get("ratios", {}).items():
            kind = "traffic" if key.startswith("traffic") else key
            if kind not in worst or abs(ratio - 1) > abs(worst[kind]["ratio"] - 1):
                worst[kind] = {"ratio": ratio, "mesh": row["mesh"], "options": row["options"], "model": row["model"]}
    print(json.dumps({"benchmark": "planner", "cells": len(rows), "worst": worst}, default=float))


if __name__ == "__main__":
    main()

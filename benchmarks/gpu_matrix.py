"""Every strategy of the CPU matrix compiled for NVIDIA hosts on this machine (issue 54, item 4): one JSON row a cell.

Each cell is the built-in tiny Llama (or the tiny MoE) compiled for a target (`jaxpar.core.target`: `h100x8`, and
`2xh100x8` for the cells that cross hosts) through `jaxpar inspect`'s own path, so what comes back is what
`jaxpar inspect --target ... --json` reports. A row holds the compile's seconds, the attention (and MoE) kernel
chosen, the collectives by kind and mesh axes, the memory per device, the planner's prediction over the compiled
figure for argument bytes and traffic per axis, and two checks: every collective the strategy must issue is there
(`expected_axes`: the axes its traffic must cross), and the planner's argument bytes are within 10%.

Needs JAX's CUDA plugin (`pip install "jaxpar[gpu-target]"`, README: "Compiling for a GPU without one") and
JAX_PLATFORMS=cpu. Usage: JAX_PLATFORMS=cpu python benchmarks/gpu_matrix.py [--cells a,b] [--seq-len 32]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from jaxpar.core import target as target_lib
from jaxpar.core.plan import Plan
from jaxpar.planner import compare
from jaxpar.planner.adapters import with_lora
from jaxpar.planner.devices import for_facts
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.model import Model
from jaxpar.run.report import inspection
from jaxpar.run.training import TrainConfig, prepare

QLORA_SHAPES = {"d_model": 128, "n_heads": 2, "n_kv_heads": 2, "head_dim": 64, "d_ff": 256}  # NF4: 64-value blocks
PALLAS_HEADS = {"head_dim": 16}  # jaxpar's Pallas kernel takes heads of 16 or more

# name: (target, mesh, plan options, model, model overrides, the mesh axes its collectives must cross)
CELLS = {
    "dp": ("h100x8", "data=8", {}, "tiny", {}, {"data"}),
    "zero1": ("h100x8", "data=8", {"zero": 1}, "tiny", {}, {"data"}),
    "zero2": ("h100x8", "data=8", {"zero": 2}, "tiny", {}, {"data"}),
    "zero3": ("h100x8", "data=8", {"zero": 3}, "tiny", {}, {"data"}),
    "hsdp": ("h100x8", "replica=2,data=4", {"zero": 3}, "tiny", {}, {"data", "replica"}),
    "tensor-sp": ("h100x8", "data=2,tensor=4", {"sequence_parallel": True}, "tiny", {}, {"data", "tensor"}),
    "tensor-explicit": ("h100x8", "data=2,tensor=4", {"tensor_form": "explicit"}, "tiny", {}, {"data", "tensor"}),
    "gpipe": ("h100x8", "data=2,pipe=4", {"schedule": "gpipe", "microbatches": 4}, "tiny", {}, {"data", "pipe"}),
    "1f1b": ("h100x8", "data=2,pipe=4", {"schedule": "1f1b", "microbatches": 8}, "tiny", {}, {"data", "pipe"}),
    "interleaved": ("h100x8", "data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4},
                    "tiny", {}, {"data", "pipe"}),
    "zb-h1": ("h100x8", "data=4,pipe=2", {"schedule": "zb-h1", "microbatches": 4}, "tiny", {}, {"data", "pipe"}),
    "3d": ("h100x8", "data=2,tensor=2,pipe=2", {"zero": 1, "microbatches": 4}, "tiny", {}, {"data", "tensor", "pipe"}),
    "expert": ("h100x8", "data=2,expert=4", {}, "moe-tiny", {}, {"data", "expert"}),
    "expert-tensor-zero3": ("h100x8", "data=2,expert=2,tensor=2", {"zero": 3}, "moe-tiny", {},
                            {"data", "expert", "tensor"}),
    "context-ring": ("h100x8", "data=2,context=4", {"context_form": "ring"}, "tiny", {}, {"data", "context"}),
    "context-all-gather": ("h100x8", "data=2,context=4", {"context_form": "all-gather"}, "tiny", {},
                           {"data", "context"}),
    # refused for a target (JAX gives compile-only devices no host memory space): its row is that one line
    "offload": ("h100x8", "data=8", {"zero": 3, "offload": "optimizer", "precision": "fp32"}, "tiny", {}, {"data"}),
    "lora": ("h100x8", "data=8", {"lora_rank": 4}, "tiny", {}, {"data"}),
    "qlora": ("h100x8", "data=8", {"lora_rank": 4, "base_dtype": "nf4"}, "tiny", QLORA_SHAPES, {"data"}),
    "attention-pallas": ("h100x8", "data=8", {"attention": "pallas", "precision": "fp32"}, "tiny", PALLAS_HEADS,
                         {"data"}),
    "attention-flash": ("h100x8", "data=8", {"attention": "flash"}, "tiny", {}, {"data"}),
    "attention-xla": ("h100x8", "data=8", {"attention": "xla"}, "tiny", {}, {"data"}),
    "hosts-hsdp": ("2xh100x8", "replica=2,data=8", {"zero": 2}, "tiny", {}, {"data", "replica"}),
    "hosts-pipe": ("2xh100x8", "pipe=2,data=8", {"microbatches": 2}, "tiny", {}, {"data", "pipe"}),
}


def compile_cell(name: str, seq_len: int, batch_size: int) -> dict:
    """One cell compiled for its target and read back, beside the planner's figures for its layout."""
    target, mesh, options, model, overrides, expected = CELLS[name]
    options = {"precision": "bf16", **options}
    start = time.perf_counter()
    plan = Plan.create(mesh, target=target, **options)
    run = prepare(TrainConfig(model=model, batch_size=batch_size, seq_len=seq_len, model_overrides=overrides), plan)
    report = inspection(run)
    seconds = time.perf_counter() - start
    collectives = collections.Counter()
    for op in report["collectives"]:
        collectives[f"{op['kind']} over {','.join(op['axes'])}"] += op.get("count", 1)
    crossed = {axis for op in report["collectives"] for axis in op["axes"]}
    row = {"cell": name, "target": target, "mesh": mesh, "options": options, "compile_s": round(seconds, 1),
           "attention": report["attention"], "moe_kernel": report.get("moe_kernel"),
           "collectives": dict(collectives), "memory_bytes": report["memory"],
           "expected_axes": sorted(expected), "axes_ok": expected <= crossed}
    row.update(planner_row(name, seq_len, batch_size, report))
    return row


def planner_row(name: str, seq_len: int, batch_size: int, report: dict) -> dict:
    """The planner's prediction over the compiled figures, or why the planner does not count this layout."""
    target, mesh, options, model, overrides, _ = CELLS[name]
    sizes = {axis: int(n) for axis, n in (part.split("=") for part in mesh.split(","))}
    layout_options = {k: v for k, v in {"precision": "bf16", **options}.items() if k in Layout.__dataclass_fields__}
    counted = Model.named(model, {"seq_len": seq_len, **overrides})
    if options.get("lora_rank"):  # the planner's LoRA inventory: adapters trained beside the frozen (maybe NF4) base
        plan = Plan.create(mesh, target=target, **options)
        counted = with_lora(counted, plan.lora_rank, plan.lora_targets, plan.base_dtype)
    try:
        est = estimate(counted, Layout(**sizes, **layout_options), Workload(batch_size=batch_size, seq_len=seq_len),
                       for_facts(target_lib.parse(target).facts()))
    except ValueError as error:  # a layout the planner's search does not hold (its schedules, say)
        return {"planner": f"not counted: {error}"}
    if est.reason:
        return {"planner": f"not counted: {est.reason}"}
    ratios = compare.ratios(est, report)
    return {"planner_over_compiled": {k: round(v, 3) for k, v in ratios.items()},
            "arguments_ok": abs(ratios["arguments"] - 1) <= 0.10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated cell names")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    missing = target_lib.plugin_missing()
    if missing:
        print(json.dumps({"error": missing}))
        return 2
    unknown = [c for c in args.cells.split(",") if c not in CELLS]
    if unknown:
        print(json.dumps({"error": f"unknown cells {unknown}; known: {sorted(CELLS)}"}))
        return 2
    for name in args.cells.split(","):
        try:
            row = compile_cell(name, args.seq_len, args.batch_size)
        except Exception as error:  # noqa: BLE001 - a cell that does not compile is a row of the table
            row = {"cell": name, "error": f"{type(error).__name__}: {str(error)[:500]}"}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

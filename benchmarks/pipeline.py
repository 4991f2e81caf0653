"""Pipeline figures as JSON, read back from compiled train steps on pipe = 4 (one sequence per microbatch):

- each schedule's bubble fraction from its tick table, against (p-1)/(v*m+p-1);
- matmul FLOPs of the pipelined step (per device x p) over those of the unpipelined step on
  one device, against (v*m+p-1)/(v*m): the bubble ticks are the only extra work, so
  1 - 1/ratio is the bubble the compiled step shows (`flops_bubble`);
- bytes passed between stages (collective-permutes over pipe, per device and direction) against
  v x m x one microbatch's activation bytes (each of a device's v chunks hands every microbatch on
  once), every other collective over pipe, and the collective-permutes that run once per step,
  outside the tick loops (none: the state holds the layers in the schedule's order, jaxpar.pipeline.layer_order);
- the temp memory of the compiled step for m = 8, 16, 32 at a fixed microbatch size, side by side.

Measured 2026-12-01 (XLA:CPU, tiny model with 8 layers, seq 32, the layers held in pipeline order, every
slot under `lax.cond`), with a tick's slots in `jaxpar.pipeline.slot_places.ORDER`: a slot that frees ring rows before one
that takes them, in the same tick. jax 0.10.2 (jax 0.12.0.1 where it differs):

                temp MiB, m = 8 / 16 / 32   m=32 / m=8   matmul FLOPs / unpipelined (formula), m = 8 / 16 / 32
    gpipe        10.06 / 16.11 / 28.21       2.80        1.357 / 1.179 / 1.089  (1.375 / 1.188 / 1.094)
    1f1b          4.35 /  4.35 /  4.36       1.001       1.357 / 1.179 / 1.089  (1.375 / 1.188 / 1.094)
    interleaved   3.82 /  3.83 /  3.83       1.002       1.179 / 1.089 / 1.045  (1.188 / 1.094 / 1.047)
                  (3.56 /  3.56 /  3.56 with jax 0.12)
    zb-h1         4.35 /  4.35 /  4.35       1.001       1.599 / 1.474 / 1.412  (1.375 / 1.188 / 1.094)

In bytes at m = 8 / 16 / 32 (jax 0.10.2): 1f1b 4561056 / 4563232 / 4567584, interleaved 4008264 / 4011856 /
4015952, zb-h1 4558880 / 4561056 / 4565408; jax 0.12: 1f1b 4567328 / 4567456 / 4567712, interleaved 3734984 /
3736656 / 3736656, zb-h1 4565248 / 4565376 / 4565632.

Residual rings: 1f1b and zb-h1 keep 6 stage-sized sets (2p - 2), interleaved 10 chunk-sized ones (5
stages' worth), gpipe every tick's. With the slots in the order F, head, B or BW, W (a row freed in a
tick taken in the next) they kept 7 and 11: 1f1b 4.81 / 4.81 / 4.82, interleaved 3.91 / 3.92 / 3.92 MiB
(jax 0.12: 3.65 / 3.66 / 3.66), zb-h1 4.85 / 4.85 / 4.85 MiB (its up to p cotangents from B to W in a
buffer of their own, 4 x 8 KiB). zb-h1 now keeps them in ring rows no residual set holds (stage i keeps
i cotangents where it keeps i sets fewer than stage 0; stage 0's W, run before its B of the same
microbatch, takes the cotangent that B takes), so its ring is 1f1b's, rows and bytes, and its temp is
2176 B below 1f1b's (2080 B with jax 0.12). It was 6912 B above (7072 B): XLA:CPU stacks the pointer
tables of conds and loops (their operand and result tuples, 8 B an array) above the large buffers, whose
peak is the same byte in both, and zb-h1 has more (B and W where 1f1b has BW, and a scan more: the ticks
with F and B before the first W). Two changes took 9088 B off (9152 B with jax 0.12): the fill an idle
forward hands on, made at the start of each tick, was an activation live through the W slot at zb-h1's
peak of the large buffers (ticks with a W now make it in the forward's cond, after the W); and a forward
runs before the head wherever no later slot of its tick frees a row of its stage (`Schedule.places`), so
the ticks before the first W, where none does, have one forward cond, not two. Interleaved saves less
than a ring row (0.09 MiB of a 0.24 MiB chunk row): its peak is not where the whole ring is. With F
and BW masked, not under `lax.cond`, 1f1b and interleaved needed one more, scratch, row for their empty
slots. zb-h1 was 5.64 / 5.64 / 5.65 MiB with B and W
masked: XLA sliced both slots' residuals out of the ring (copied into their layer loops) before
either ran, so both sets were live at once. A slot writing the ring after others read it in its tick
writes at an index computed from a token their conds return: without that XLA copied the whole ring
each tick (7.71 MiB for 1f1b at m = 8). A stage whose layers permute (ring attention) computes each
slot once per tick, masked, and writes the ring after its reads, fenced in a cond every device takes:
pipe=2 x context=2, m = 4, its temp fell from 2.08 to 1.75 MiB (1f1b), 2.10 to 1.77 MiB (zb-h1). The FLOPs ratios sit just
below the formula (within 1.5%), and count each slot's work on every tick, bubble slots included,
which `lax.cond` skips at run time, once for a slot with two places in a tick (a stage runs it at one):
the head and embedding are not multiplied by the bubble (interleaved runs its head only on ticks
with a last chunk's output; running it on every steady tick put it 1.3 / 2.9 / 3.8% above the
formula). zb-h1's W slot replays the stage's stored VJP, which recomputes the input-gradient chain,
so its table idles less than 1f1b's but its FLOPs are higher. Not done: B keeping each layer's output cotangent
would let W run layer by layer and drop only the matmuls into each layer's input (wq, wk and wv's:
3 of a llama block's 7 input-gradient matmuls; the others feed the block's weight gradients), for
L/p - 1 more saved activations per cotangent in flight, and the stage function (`Stages.layers`)
would have to run one layer at a time.
No schedule moves weights per step (permutes_outside_loops: 0): interleaved's
state holds the layers in its chunks' order (jaxpar.pipeline.layer_order). Before, it moved them into that
order and their gradients back every step: 18 collective-permutes outside the tick loops, 591872 B
per device at m = 8 (65% of its 903168 permuted bytes; 311296 now, all activations and cotangents).

ZB-H1 against 1F1B (`--zb-h1`: p = 2, 4 and m = 8, 16 on pipe alone), measured 2026-12-04, jax 0.10.2, temp bytes
1f1b / zb-h1 (ratio), bubble 1f1b / zb-h1:

    p=2 m=8    4597344 / 4592224 (0.9989)   0.111 / 0.077      before: zb-h1 5185696 (1.128)
    p=2 m=16   4599456 / 4594336 (0.9989)   0.059 / 0.040      before: zb-h1 5187808 (1.128)
    p=4 m=8    4536480 / 4534304 (0.9995)   0.273 / 0.200      (unchanged)
    p=4 m=16   4538656 / 4536480 (0.9995)   0.158 / 0.111      (unchanged)

At p = 2 every stage runs the W of the last microbatch in the last tick: XLA folded that W's cond (its
predicate the same on every stage) and scheduled the replay's zero-filled gradient buffers at the start of
the step, live through its peak; an optimization barrier on the predicate keeps the cond. A run of one tick
(zb-h1's F and B tick before the first W) is folded into the next run, its W idle there: XLA unrolled it,
tracing its conds' operand tables once more. On the issue's shape (4 layers, seq 64, data=4 x pipe=2) zb-h1
went from 5846048 to 5547936 B (m = 8; 1f1b 5545632): its large buffers peak within 384 B of 1f1b's, and
2304 B of XLA:CPU's cond and loop pointer tables (B and W are two conds where 1f1b has one) stay above.

    python benchmarks/pipeline.py [--microbatches 8,16,32] [--seq-len 32] [--zb-h1]
"""

import argparse
import dataclasses
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.planner import inspect  # noqa: E402
from jaxpar.models.llama import CONFIGS, Llama  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.pipeline.schedule import Schedule  # noqa: E402
from jaxpar.train.state import abstract_state, describe  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

STAGES = 4
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def compile_step(model, optimizer, plan: Plan, batch: int, seq: int):
    spec = jax.ShapeDtypeStruct((batch, seq), np.int32)
    step = make_train_step(model, lambda module, b: module(b), optimizer, plan)
    return step.lower(abstract_state(model, optimizer, plan), {"inputs": spec, "targets": spec}).compile()


def measure(model, optimizer, config, name: str, v: int, m: int, reference_flops: float) -> dict:
    plan = Plan.create(f"pipe={STAGES}", devices=jax.devices()[:STAGES], schedule=name, microbatches=m,
                       virtual_stages=v)
    compiled = compile_step(model, optimizer, plan, m, config.seq_len)
    schedule = Schedule(name, STAGES, m, v)
    activation = config.seq_len * config.d_model * 4
    over_pipe = [r for r in inspect.collectives(compiled, plan.mesh) if r["axes"] == ["pipe"]]
    permutes = [op for op in inspect.collective_ops(compiled, plan.mesh)
                if op.kind == "collective-permute" and op.axes == ("pipe",)]
    permuted = sum(op.count * op.bytes for op in permutes if op.bytes == activation)
    outside = [op for op in permutes if op.count == 1]
    flops_ratio = inspect.matmul_flops(compiled) * STAGES / reference_flops
    goal = (v * m + STAGES - 1) / (v * m)
    return {
        "schedule": name, "virtual_stages": v, "microbatches": m, "ticks": schedule.ticks,
        "bubble": schedule.bubble, "bubble_formula": schedule.bubble_formula,
        "flops_ratio": flops_ratio, "flops_ratio_formula": goal, "flops_within_goal": flops_ratio <= goal * 1.05,
        "flops_bubble": 1 - 1 / flops_ratio,
        "stage_bytes_per_direction": permuted / 2, "ideal_stage_bytes_per_direction": v * m * activation,
        "stage_bytes_over_ideal": permuted / 2 / (v * m * activation),
        "permutes_outside_loops": len(outside), "permute_bytes_outside_loops": sum(op.bytes for op in outside),
        "collectives_over_pipe": over_pipe,
        "memory": inspect.memory(compiled),
        "in_flight_chunk_sets": schedule.in_flight, "live_microbatches": schedule.live_microbatches,
    }


def zb_h1_table(model, optimizer, config) -> dict:
    """ZB-H1 against 1F1B at p = 2, 4 and m = 8, 16 (pipe only): compiled temp bytes and the tables' bubbles."""
    cells = []
    for p in (2, 4):
        for m in (8, 16):
            cell = {"stages": p, "microbatches": m}
            for name in ("1f1b", "zb-h1"):
                plan = Plan.create(f"pipe={p}", devices=jax.devices()[:p], schedule=name, microbatches=m)
                cell[name] = {"temp": inspect.memory(compile_step(model, optimizer, plan, m, config.seq_len))["temp"],
                              "bubble": Schedule(name, p, m).bubble}
            cell["temp_ratio"] = cell["zb-h1"]["temp"] / cell["1f1b"]["temp"]
            cell["zb_h1_within_1f1b_memory"] = cell["zb-h1"]["temp"] <= cell["1f1b"]["temp"]
            cell["zb_h1_smaller_bubble"] = cell["zb-h1"]["bubble"] < cell["1f1b"]["bubble"]
            cells.append(cell)
    return {"benchmark": "pipeline_zb_h1_vs_1f1b", "layers": config.n_layers, "seq_len": config.seq_len,
            "cells": cells, "all_within": all(c["zb_h1_within_1f1b_memory"] and c["zb_h1_smaller_bubble"]
                                              for c in cells)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", default="8,16,32", help="comma-separated m values for the series")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--zb-h1", action="store_true", help="only the ZB-H1 vs 1F1B table (p = 2, 4; m = 8, 16)")
    args = parser.parse_args()
    series = [int(m) for m in args.microbatches.split(",")]
    config = dataclasses.replace(CONFIGS["tiny"], n_layers=8, seq_len=args.seq_len)
    model, optimizer = describe(lambda: Llama(config, nnx.Rngs(0))), optax.adamw(1e-3)
    if args.zb_h1:
        print(json.dumps(zb_h1_table(model, optimizer, config), indent=1))
        return
    single = Plan.create("data=1", devices=jax.devices()[:1])
    results = []
    for m in series:
        reference_flops = inspect.matmul_flops(compile_step(model, optimizer, single, m, config.seq_len))
        for name, v in SCHEDULES:
            results.append(measure(model, optimizer, config, name, v, m, reference_flops))
    temp = {name: {r["microbatches"]: r["memory"]["temp"] for r in results if r["schedule"] == name}
            for name, _ in SCHEDULES}
    bubbles = {name: {r["microbatches"]: {"flops": r["flops_bubble"], "table": r["bubble"],
                                          "formula": r["bubble_formula"]}
                      for r in results if r["schedule"] == name} for name, _ in SCHEDULES}
    print(json.dumps({
        "benchmark": "pipeline", "stages": STAGES, "layers": config.n_layers, "seq_len": config.seq_len,
        "microbatch_sequences": 1, "activation_bytes": config.seq_len * config.d_model * 4,
        "temp_memory_series": temp,
        "temp_growth_m_last_over_first": {name: s[series[-1]] / s[series[0]] for name, s in temp.items()},
        "bubble_series": bubbles,
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()

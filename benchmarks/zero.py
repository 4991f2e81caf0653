"""ZeRO figures as JSON: per-device model-state bytes against the ZeRO formulas, collective traffic
against plain data parallelism, and peak memory and step time for each remat policy.

    python benchmarks/zero.py [--model small] [--precision fp32] [--steps 2]

Model-state bytes are read from the compiled step: the parameters and optimizer state are its
arguments (each device's shards); the gradients are the buffers its gradient collectives reduce
(the whole local gradient under ZeRO-0/1, the reduce-scattered shards under ZeRO-2/3); ZeRO-2 also
holds the parameters its forward pass gathered until the backward pass has used them (the compiled
backward pass gathers nothing), while ZeRO-3 gathers each layer again and holds one at a time.
The formulas count P, G and K bytes per parameter for the parameters, gradients and optimizer
state of the dtypes used, Psi parameters and N data ranks:
(P+G+K)Psi, (P+G)Psi + K Psi/N, P Psi + (G+K)Psi/N and (P+G+K)Psi/N. Under bf16/fp16 jaxpar holds
fp32 parameters once and 2-byte gradients (4 + 2 + 8) at ZeRO-0/2/3, and at ZeRO-1, whose parameters are whole on every
rank, 2-byte parameters and an fp32 master sharded with Adam's moments (2 + 2 + 12, ZeRO's P_os;
issue 16: the step's arguments at data=8 on a 655,680-parameter model 3.28 -> 2.30 MB, temp
5.07 -> 4.34 MB). P and K are read from each stage's own state.
"""

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.planner import inspect  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.run.training import TrainConfig, prepare  # noqa: E402


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def compile_and_time(args, seq_len: int, **options) -> dict:
    """Compile one step of `options` on the data axis, run it, and read back what it holds and moves."""
    plan = Plan.create(f"data={args.data}", **options)
    config = TrainConfig(model=args.model, batch_size=args.batch_size, seq_len=seq_len, steps=args.steps + 1)
    run = prepare(config, plan)
    state = run.init()
    batch = run.batch(0)
    compiled = run.step_fn.lower(state, batch).compile()
    sizes = {"params": device_bytes(state.params), "optimizer": device_bytes(state.opt_state)}
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        state, metrics = compiled(state, run.batch(step))
    jax.block_until_ready(metrics)
    return {
        "plan": plan,
        "param_count": run.model.param_count(),
        "state": sizes,
        "collectives": inspect.collectives(compiled, plan.mesh),
        "memory": inspect.memory(compiled),
        "step_time_s": (time.perf_counter() - began) / args.steps,
    }


def model_state(measured: dict) -> dict:
    """Per-device parameter, gradient and optimizer-state bytes, and the traffic, of one ZeRO stage."""
    plan, rows = measured["plan"], measured["collectives"]
    n = plan.shape["data"]
    total = {kind: sum(r["bytes"] for r in rows if r["kind"] == kind and r["axes"] == ["data"])
             for kind in ("all-reduce", "reduce-scatter", "all-gather")}
    gradients = {0: total["all-reduce"], 1: total["reduce-scatter"]}.get(plan.zero, total["reduce-scatter"] / n)
    held = total["all-gather"] if plan.zero == 2 else 0
    parts = {"params_at_rest": measured["state"]["params"], "gathered_params_held": held,
             "gradients": gradients, "optimizer": measured["state"]["optimizer"]}
    return {**parts, "total": sum(parts.values()), "traffic": sum(r["traffic"] for r in rows)}


def formula(stage: int, psi: int, p: float, g: float, k: float, n: int) -> float:
    return {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / n,
            2: p * psi + (g + k) * psi / n, 3: (p + g + k) * psi / n}[stage]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16, fp16 or bf16-params (on CPU XLA sums bf16 collectives in fp32; jaxpar moves gathers as 16-bit bits)")
    parser.add_argument("--data", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--remat-zero", type=int, default=0, help="ZeRO stage of the remat comparison")
    parser.add_argument("--remat-seq-len", type=int, default=256, help="sequence length of the remat comparison")
    args = parser.parse_args()

    stages = {z: compile_and_time(args, args.seq_len, zero=z, precision=args.precision) for z in range(4)}
    psi = stages[0]["param_count"]
    p = stages[0]["state"]["params"] / psi
    k = stages[0]["state"]["optimizer"] / psi
    p1 = stages[1]["state"]["params"] / psi  # ZeRO-1 under bf16/fp16: 2-byte params, the fp32 master in K
    k1 = stages[1]["state"]["optimizer"] * args.data / psi
    states = {z: model_state(m) for z, m in stages.items()}
    zero = []
    for z, m in stages.items():
        expected = formula(z, psi, p1, p1, k1, args.data) if z == 1 else formula(z, psi, p, p, k, args.data)
        zero.append({
            "zero": z,
            "model_state_bytes": states[z],
            "formula_bytes": expected,
            "model_state_over_formula": states[z]["total"] / expected,
            "traffic_over_dp": states[z]["traffic"] / states[0]["traffic"],
            "memory": m["memory"],
            "step_time_s": m["step_time_s"],
        })

    remat = []
    for policy in ("none", "selective", "full"):
        m = compile_and_time(args, args.remat_seq_len, zero=args.remat_zero, precision=args.precision, remat=policy)
        remat.append({"remat": policy, "peak_bytes": m["memory"]["arguments"] + m["memory"]["temp"],
                      "temp_bytes": m["memory"]["temp"], "step_time_s": m["step_time_s"]})
    print(json.dumps({
        "benchmark": "zero",
        "model": args.model,
        "params": psi,
        "precision": args.precision,
        "bytes_per_param": {"P": p, "G": p, "K": k, "zero1": {"P": p1, "G": p1, "K": k1}},
        "data": args.data,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "stages": zero,
        "remat": {"zero": args.remat_zero, "seq_len": args.remat_seq_len, "policies": remat},
    }, indent=1, default=float))


if __name__ == "__main__":
    main()

"""Data parallelism figures as JSON: gradient all-reduce bytes against the parameter bytes,
ring traffic against 2(n-1)/n, memory, and step time for data = 1, 2, 4, 8.

    python benchmarks/data_parallel.py [--model small] [--steps 10]
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


def measure(model: str, data: int, steps: int, batch: int, seq: int) -> dict:
    plan = Plan.create(f"data={data}", devices=jax.devices()[:data])
    run = prepare(TrainConfig(model=model, batch_size=batch, seq_len=seq, steps=steps + 2), plan)
    state = run.init()
    compiled = run.step_fn.lower(state, run.batch(0)).compile()
    rows = inspect.collectives(compiled, plan.mesh)
    reduced = sum(r["bytes"] for r in rows if r["kind"] == "all-reduce" and r["axes"] == ["data"])
    traffic = sum(r["traffic"] for r in rows)
    for step in range(2):
        state, metrics = run.step_fn(state, run.batch(step))
    jax.block_until_ready(metrics)
    began = time.perf_counter()
    for step in range(2, steps + 2):
        state, metrics = run.step_fn(state, run.batch(step))
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - began) / steps
    param_bytes = run.model.param_bytes()
    return {
        "data": data,
        "param_bytes": param_bytes,
        "all_reduce_bytes": reduced,
        "all_reduce_bytes_over_param_bytes": reduced / param_bytes,
        "traffic_bytes": traffic,
        "ring_formula_bytes": 2 * (data - 1) / data * reduced,
        "memory": inspect.memory(compiled),
        "step_time_s": seconds,
        "tokens_per_s": batch * seq / seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    results = [measure(args.model, d, args.steps, args.batch_size, args.seq_len) for d in (1, 2, 4, 8)]
    print(json.dumps({"benchmark": "data_parallel", "model": args.model, "results": results}, indent=1))


if __name__ == "__main__":
    main()

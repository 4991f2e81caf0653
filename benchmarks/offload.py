"""Host offload of the optimizer state as JSON: compiled device memory with and without `--offload optimizer`.

    python benchmarks/offload.py [--model small] [--mesh data=8] [--zero 1] [--precision bf16] [--steps 5]

For each setting it compiles and runs the same step and prints the compiled
step's `memory_analysis` (device and host parts), the optimizer-state bytes
each device holds, and the median step time. With offload the device's
argument bytes should fall by the optimizer-state bytes (and their host
argument bytes rise by as much). The CPU backend counts its `pinned_host`
space with the device's (its host_* figures stay 0), so run this on a GPU to
see the saving; on CPU it shows that both settings compile and train alike.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.run.training import TrainConfig, prepare  # noqa: E402


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays."""
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def measure(args, offload: str) -> dict:
    plan = Plan.create(args.mesh or f"data={jax.device_count()}", zero=args.zero, precision=args.precision,
                       offload=offload)
    run = prepare(TrainConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                              steps=args.steps + 1), plan)
    state = run.init()
    compiled = run.step_fn.lower(state, run.batch(0)).compile()
    stats = compiled.memory_analysis()
    memory = {name: getattr(stats, f"{name}_size_in_bytes") for name in
              ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_alias", "host_temp")}
    times, losses = [], []
    for step in range(args.steps + 1):
        began = time.perf_counter()
        state, metrics = compiled(state, run.batch(step))
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - began)
    return {
        "offload": offload,
        "memory": memory,
        "optimizer_bytes_per_device": device_bytes(state.opt_state),
        "opt_state_memory_kinds": sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}),
        "median_step_s": statistics.median(times[1:]),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default=None, help="default: data over every device")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = {offload: measure(args, offload) for offload in ("none", "optimizer")}
    kept, offloaded = rows["none"], rows["optimizer"]
    print(json.dumps({
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "settings": vars(args),
        "runs": list(rows.values()),
        "device_argument_bytes_saved": kept["memory"]["argument"] - offloaded["memory"]["argument"],
        "optimizer_bytes_per_device": kept["optimizer_bytes_per_device"],
        "same_losses": kept["losses"] == offloaded["losses"],
        "step_time_ratio": offloaded["median_step_s"] / kept["median_step_s"],
    }, indent=1))


if __name__ == "__main__":
    main()

"""Checkpoint figures as JSON: async save time (the blocking part and the total), bytes written,
and restore time onto the saving plan and onto another one, for a model of a few hundred MB.

    python benchmarks/checkpoint.py [--d-model 1024] [--layers 6] [--mesh data=2,tensor=2,pipe=2] [--dir DIR]

The train state is created directly sharded and given Adam moments by updates
with random gradients (freshly initialised moments are zeros, which compress to
nothing), so nothing is compiled but the initialisation and that update.
"""

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.train.checkpoint import Checkpoints  # noqa: E402
from jaxpar.models.llama import CONFIGS, Llama  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.train.state import TrainState, init_state, state_specs  # noqa: E402


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed_save(checkpoints: Checkpoints, step: int, state) -> dict:
    began = time.perf_counter()
    checkpoints.save(step, state, force=True)
    blocking = time.perf_counter() - began
    checkpoints.wait()
    total = time.perf_counter() - began
    return {"blocking_s": blocking, "total_s": total, "blocking_fraction": blocking / total}


def random_update(state, optimizer, shardings, seed: int):
    """One optimizer step with standard-normal gradients: a state whose moments look like training's."""

    def update(state):
        leaves, tree = jax.tree.flatten(state.params)
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        grads = tree.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)

    return jax.jit(update, out_shardings=shardings, donate_argnums=0)(state)


def timed_restore(checkpoints: Checkpoints, model, optimizer, plan: Plan) -> float:
    began = time.perf_counter()
    state, _ = checkpoints.restore(model, optimizer, plan)
    jax.block_until_ready(state)
    return time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--mesh", default="data=2,tensor=2,pipe=2")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--restore-mesh", default="data=8")
    parser.add_argument("--restore-zero", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    args = parser.parse_args()

    config = dataclasses.replace(CONFIGS["small"], d_model=args.d_model, n_layers=args.layers, n_heads=16,
                                 n_kv_heads=8, head_dim=args.d_model // 16, d_ff=4 * args.d_model)
    optimizer = optax.adamw(1e-3)
    plan = Plan.create(args.mesh, zero=args.zero)
    began = time.perf_counter()
    model, state = init_state(lambda: Llama(config, nnx.Rngs(0)), optimizer, plan)
    shardings = plan.shardings(state_specs(model, optimizer, plan))
    state = jax.block_until_ready(random_update(state, optimizer, shardings, seed=1))
    init_s = time.perf_counter() - began
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="jaxpar-checkpoint-bench-"))
    try:
        with Checkpoints(root / "run") as checkpoints:
            first = timed_save(checkpoints, 1, state)
            state = jax.block_until_ready(random_update(state, optimizer, shardings, seed=2))
            steady = timed_save(checkpoints, 2, state)
            written = directory_bytes(root / "run" / "2")
            same = timed_restore(checkpoints, model, optimizer, plan)
            other_plan = Plan.create(args.restore_mesh, zero=args.restore_zero)
            other = timed_restore(checkpoints, model, optimizer, other_plan)
    finally:
        if not args.dir:
            shutil.rmtree(root)

    print(json.dumps({
        "benchmark": "checkpoint",
        "devices": jax.device_count(),
        "mesh": args.mesh, "zero": args.zero,
        "params": model.param_count(),
        "param_bytes": model.param_bytes(),
        "state_bytes": state_bytes,
        "init_and_update_s": init_s,
        "first_save": first,
        "save": steady,
        "bytes_written": written,
        "write_bytes_per_s": written / steady["total_s"],
        "restore_s": same,
        "restore_other_plan": {"mesh": args.restore_mesh, "zero": args.restore_zero, "restore_s": other},
    }, indent=1))


if __name__ == "__main__":
    main()

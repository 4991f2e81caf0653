"""jaxpar's train step with one of its changes undone, against the step as it is: compiled in one process, interleaved.

A change to the step is measured where it acts: a product or a collective on
its own compiles unlike the same one inside the step (XLA:CPU widened the
isolated products to fp32 or left them unfused). So this times the whole step
of issue 16's model (the MaxText-paired llama2, `peers/jaxpar/maxtext-model.toml`)
on 8 host devices, with and without the change, both compiled in one process
and run step for step in turn, so the machine's drift falls on both alike.
Each change is undone by patching jaxpar while the step before it is compiled:

- `weight_gradient` (cause 17): x copied wherever x alone is smaller than the
  weight, instead of `matmul._copies_x`;
- `wide_logits` (cause 18): the output layer's logits made in the compute
  dtype and widened to fp32 afterwards, instead of written in fp32 by the matmul;
- `target_logit` (cause 20): the loss's target logit summed from a where over
  the whole [tokens, vocab] logits, instead of read at the target;
- `bits` (cause 19): 16-bit collectives as `jax.lax`'s, which XLA:CPU widens to
  fp32, instead of moved as their bits (`jaxpar.parallel.bits`).

Prints one JSON line per layout: whether the two compiled steps are the same
(the change does not act there), the compiled memory per device of each, the
median wall and process-CPU time per step of each (steps after the first two
of each round), and now / before.

    python benchmarks/in_step.py --change wide_logits [--layouts fsdp8 dp8] [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from vs_maxtext import CONFIG, LAYOUTS  # noqa: E402

from jaxpar import cli  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.parallel import bits, matmul, tensor, tensor_explicit, vocab  # noqa: E402
from jaxpar.planner import inspect  # noqa: E402
from jaxpar.run.training import prepare  # noqa: E402


def _narrow_logits(equation, x, w, out_dtype=None):
    y = matmul.weight_einsum(equation, x, w)
    return y if out_dtype is None else y.astype(out_dtype)


def _one_hot_sum(size, logits, targets):
    return jnp.sum(jnp.where(vocab.is_target(targets, size), logits, 0.0), axis=-1)


BEFORE = {  # change: (the modules that look the attribute up, attribute, what it was before the change)
    "weight_gradient": ((matmul,), "_copies_x", lambda x, w, cotangent: x.size < w.size),
    "wide_logits": ((tensor, tensor_explicit), "weight_einsum", _narrow_logits),
    "target_logit": ((vocab,), "target_logit", _one_hot_sum),
    "bits": ((bits,), "_widened", lambda tree: False),
}


@contextlib.contextmanager
def undone(change: str | None):
    if change is None:
        yield
        return
    modules, attribute, before = BEFORE[change]
    now = [getattr(module, attribute) for module in modules]
    for module in modules:
        setattr(module, attribute, before)
    try:
        yield
    finally:
        for module, was in zip(modules, now):
            setattr(module, attribute, was)


def compiled(config_path: Path, layout: str, extra: list[str], change: str | None):
    """The layout's run, its state and its step, compiled with `change` undone (None: as it is)."""
    args = cli.build_parser().parse_args(["train", "--config", str(config_path), *LAYOUTS[layout], *extra])
    config, options, mesh = cli.resolve(args)
    with undone(change):
        run = prepare(config, Plan.create(mesh, **options))
        state = run.init()
        step = run.step_fn.lower(state, run.batch(0)).compile()
    return run, state, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--change", required=True, choices=sorted(BEFORE))
    parser.add_argument("--layouts", nargs="+", default=["fsdp8", "dp8"], choices=sorted(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per variant and round; the first two untimed")
    parser.add_argument("--config", type=Path, default=Path(CONFIG))
    parser.add_argument("--train-args", default="", help="more `jaxpar train` arguments, e.g. '--batch-size 64'")
    args = parser.parse_args()
    if not args.config.is_file():
        parser.error(f"no model config at {args.config} (the MaxText-paired model, benchmarks/maxtext-model.toml); pass --config")
    for layout in args.layouts:
        variants = {name: compiled(args.config, layout, args.train_args.split(), change)
                    for name, change in (("before", args.change), ("now", None))}
        texts = {name: step.as_text() for name, (_, _, step) in variants.items()}
        row = {"layout": layout, "change": args.change, "train_args": args.train_args,
               "same_step": texts["before"] == texts["now"]}
        row |= {f"{name}_memory_mb": round(inspect.memory(step)["total"] / 1e6, 2)
                for name, (_, _, step) in variants.items()}
        states = {name: state for name, (_, state, _) in variants.items()}
        wall = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        for _ in range(args.rounds):
            for step in range(args.steps):
                for name, (run, _, compiled_step) in variants.items():
                    batch = run.batch(step)
                    began, began_cpu = time.perf_counter(), time.process_time()
                    states[name], metrics = compiled_step(states[name], batch)
                    jax.block_until_ready((states[name], metrics))
                    if step >= 2:
                        wall[name].append(time.perf_counter() - began)
                        cpu[name].append(time.process_time() - began_cpu)
        row |= {"rounds": args.rounds, "timed_steps": len(wall["now"])}
        for name in variants:
            row[f"{name}_wall_s"] = round(statistics.median(wall[name]), 4)
            row[f"{name}_cpu_s"] = round(statistics.median(cpu[name]), 4)
        row["wall_ratio"] = round(row["now_wall_s"] / row["before_wall_s"], 3)
        row["cpu_ratio"] = round(row["now_cpu_s"] / row["before_cpu_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

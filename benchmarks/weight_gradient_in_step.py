"""jaxpar's train step with its weight gradients formed by the old rule and by `matmul._copies_x`, interleaved.

`jaxpar.matmul` makes a weight gradient one of two ways on XLA:CPU: x copied
into [features, tokens] (the cotangent becomes the dot's right operand), or
the gradient made with the weight's output features first and transposed
into the weight's order. Which is faster depends on what surrounds the dot
in the step (the cotangent's producer, the gradient's fp32 sum or
reduce-scatter), which a dot on its own does not reproduce: there XLA:CPU
widened the same products to fp32 or left them unfused. So this times the
whole step of issue 16's model (the MaxText-paired llama2, `peers/jaxpar/
maxtext-model.toml`) on 8 host devices, both variants compiled in one process
and run step for step in turn, so the machine's drift falls on both alike.

- `before`: x copied wherever x alone is smaller than the weight;
- `after`: `matmul._copies_x` (x and the cotangent both smaller than the weight).

Prints one JSON line per layout: whether the two compiled steps are the same
(the rules agree on every weight there), the median wall and process-CPU
time per step of each (steps after the first two of each round), and
after / before.

    python benchmarks/weight_gradient_in_step.py [--layouts fsdp8 dp8] [--rounds 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
from vs_maxtext import CONFIG, LAYOUTS  # noqa: E402

from jaxpar import cli, matmul  # noqa: E402
from jaxpar.plan import Plan  # noqa: E402
from jaxpar.train import prepare  # noqa: E402

RULES = {"before": lambda x, w, cotangent: x.size < w.size, "after": matmul._copies_x}


def compiled(config_path: Path, layout: str, extra: list[str], rule):
    """The layout's run, its state and its step compiled with `rule` deciding every weight gradient's form."""
    args = cli.build_parser().parse_args(["train", "--config", str(config_path), *LAYOUTS[layout], *extra])
    config, options, mesh = cli.resolve(args)
    run = prepare(config, Plan.create(mesh, **options))
    state = run.init()
    chosen, matmul._copies_x = matmul._copies_x, rule
    try:
        step = run.step_fn.lower(state, run.batch(0)).compile()
    finally:
        matmul._copies_x = chosen
    return run, state, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["fsdp8", "dp8"], choices=sorted(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="steps per variant and round; the first two untimed")
    parser.add_argument("--config", type=Path, default=Path(CONFIG))
    parser.add_argument("--train-args", default="", help="more `jaxpar train` arguments, e.g. '--batch-size 64'")
    args = parser.parse_args()
    if not args.config.is_file():
        parser.error(f"no model config at {args.config} (the MaxText-paired model of shared/peers); pass --config")
    for layout in args.layouts:
        variants = {name: compiled(args.config, layout, args.train_args.split(), rule) for name, rule in RULES.items()}
        texts = {name: step.as_text() for name, (_, _, step) in variants.items()}
        row = {"layout": layout, "train_args": args.train_args, "same_step": texts["before"] == texts["after"]}
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
        row |= {"rounds": args.rounds, "timed_steps": len(wall["after"])}
        for name in variants:
            row[f"{name}_wall_s"] = round(statistics.median(wall[name]), 4)
            row[f"{name}_cpu_s"] = round(statistics.median(cpu[name]), 4)
        row["wall_ratio"] = round(row["after_wall_s"] / row["before_wall_s"], 3)
        row["cpu_ratio"] = round(row["after_cpu_s"] / row["before_cpu_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

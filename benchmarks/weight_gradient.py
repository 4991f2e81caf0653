"""An output layer's weight gradient on XLA:CPU, in the two forms `jaxpar.matmul._weight_gradient` picks from.

Each of 8 host devices adds the gradient of a [d, vocab] weight into an fp32
sum, over microbatches of `tokens` tokens in a scan (a pipeline's head) or
once (tokens x microbatches at a time):

- `weight_first`: the gradient made with the weight's output features first
  (cotangent^T x, [vocab, d]) and transposed into the weight's order, as
  `_weight_gradient` does where x is the larger array;
- `x_copied`: x copied into [d, tokens] and one dot writing [d, vocab], as it
  does where x is the smaller (fewer tokens than output features).

Prints one JSON line per shape: the minimum wall time of `--repeats` calls of each.

    python benchmarks/weight_gradient.py [--d 256] [--vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

FORMS = {
    "weight_first": lambda x, g: jax.lax.optimization_barrier(g.T @ x).T,
    "x_copied": lambda x, g: jax.lax.optimization_barrier(x.T) @ g,
}


def timed(form: str, tokens: int, microbatches: int, d: int, vocab: int, repeats: int) -> float:
    mesh = jax.make_mesh((8,), ("devices",))
    sharding = NamedSharding(mesh, P("devices"))
    x = jax.device_put(jnp.ones((8 * microbatches, tokens, d), jnp.bfloat16), sharding)
    g = jax.device_put(jnp.ones((8 * microbatches, tokens, vocab), jnp.bfloat16), sharding)

    def per_device(x, g):
        def add(total, pair):
            return total + FORMS[form](*pair).astype(jnp.float32), None

        zeros = jax.lax.pcast(jnp.zeros((d, vocab), jnp.float32), ("devices",), to="varying")
        return jax.lax.scan(add, zeros, (x, g))[0]

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("devices"), P("devices")),
                                 out_specs=P("devices")))
    jax.block_until_ready(step(x, g))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x, g))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for tokens, microbatches in ((64, 4), (256, 1)):
        row = {"tokens": tokens, "microbatches": microbatches, "d": args.d, "vocab": args.vocab}
        row |= {f"{form}_s": round(timed(form, tokens, microbatches, args.d, args.vocab, args.repeats), 4)
                for form in FORMS}
        row["ratio"] = round(row["x_copied_s"] / row["weight_first_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

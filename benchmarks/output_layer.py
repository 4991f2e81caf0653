"""An output layer's input gradient on XLA:CPU, in the two forms `jaxpar.parallel.matmul._input_gradient` picks from.

Each of 8 host devices differentiates `x @ w` for a [d, vocab] weight over
microbatches of `tokens` tokens in a scan (a pipeline's head) or once (tokens x
microbatches at a time): `weight_right`, `cotangent @ w^T` (the weight is the
dot's right operand, which XLA:CPU's fused matmul runs as if it repacked on
every call); `weight_left`, `w @ cotangent^T`, [d, tokens], transposed into
x's order, where the weight is larger than the cotangent and than 1 MiB.
Isolated like this, XLA:CPU runs both as fused dots widened to fp32 (the
step runs them in bf16); their ranking agrees with pp2 x dp4's profile,
where the input-gradient dot went 504 -> 91 ms per device-step (cause 15 in
vs_maxtext.md).

The weight gradient's forms are timed in the whole step instead
(`in_step.py --change weight_gradient`): isolated here, XLA:CPU compiled them unlike
the step (fp32 products, a vocabulary-first one left unfused), and they
ranked the other way round from the step at 256 tokens.

Prints one JSON line per shape: the minimum wall time of
`--repeats` calls of each form.

    python benchmarks/output_layer.py [--d 256] [--vocab 32000] [--repeats 3]
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

FORMS = {  # form: (x [tokens, d], g [tokens, vocab], w [d, vocab]) -> the input gradient
    "weight_right": lambda x, g, w: g @ w.T,
    "weight_left": lambda x, g, w: jax.lax.optimization_barrier(w @ g.T).T,
}


def timed(form: str, tokens: int, microbatches: int, d: int, vocab: int, repeats: int) -> float:
    mesh = jax.make_mesh((8,), ("devices",))
    sharding = NamedSharding(mesh, P("devices"))
    x = jax.device_put(jnp.ones((8 * microbatches, tokens, d), jnp.bfloat16), sharding)
    g = jax.device_put(jnp.ones((8 * microbatches, tokens, vocab), jnp.bfloat16), sharding)
    w = jax.device_put(jnp.ones((8, d, vocab), jnp.bfloat16), sharding)

    def per_device(x, g, w):
        return jax.lax.scan(lambda carry, pair: (carry, FORMS[form](*pair, w[0])), None, (x, g))[1]

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("devices"),) * 3, out_specs=P("devices")))
    jax.block_until_ready(step(x, g, w))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x, g, w))
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
        row["ratio"] = round(row["weight_left_s"] / row["weight_right_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

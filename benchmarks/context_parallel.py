"""Context parallelism figures as JSON: per-device compiled memory as the sequence grows, on context = 1, 2, 4, 8.

- attention: XLA's temp bytes of jaxpar's causal attention alone (forward and backward, the shapes of one
  `tiny` layer at batch 1), per sequence length and context size, with the ratio to context = 1;
- step: temp and total bytes of `tiny`'s whole train step (AdamW) on the same grid;
- fits: the longest power-of-two sequence whose whole step fits `--budget-mib` per device, without
  context parallelism and with the largest context size given.

Nothing runs: every figure is read from a compiled step (`memory_analysis`), so the CPU backend gives them.

    python benchmarks/context_parallel.py [--seq 256 512 1024 2048] [--context 1 2 4 8] [--form all-gather]
        [--budget-mib 256]
"""

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.planner import inspect  # noqa: E402

from jaxpar.parallel import attention
from jaxpar.models.llama import CONFIGS, Llama  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.train.state import abstract_state, describe  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

OPTIMIZER = optax.adamw(1e-3)
TINY = CONFIGS["tiny"]


def plan_for(context: int, form: str) -> Plan:
    return Plan.create(f"context={context}", devices=jax.devices()[:context], context_form=form)


def attention_temp(seq: int, context: int, form: str) -> int:
    """Temp bytes of value_and_grad of one attention layer of `tiny` at batch 1."""
    q = jax.ShapeDtypeStruct((1, seq, TINY.n_heads, TINY.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, TINY.n_kv_heads, TINY.head_dim), jnp.float32)
    loss = jax.value_and_grad(lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v)), argnums=(0, 1, 2))
    with plan_for(context, form).activate():
        compiled = jax.jit(loss).lower(q, kv, kv).compile()
    return inspect.memory(compiled)["temp"]


def step_memory(seq: int, context: int, form: str) -> dict:
    """Temp and total bytes per device of `tiny`'s train step at batch 1 and this sequence length."""
    config = type(TINY)(**{**TINY.__dict__, "seq_len": seq})
    model = describe(lambda: Llama(config, nnx.Rngs(0)))
    plan = plan_for(context, form)
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
    compiled = step.lower(abstract_state(model, OPTIMIZER, plan), {"inputs": tokens, "targets": tokens}).compile()
    return inspect.memory(compiled)


def longest_fitting(context: int, form: str, budget: int, start: int = 256, limit: int = 1 << 17) -> int:
    """The longest power-of-two sequence from `start` whose step's total bytes per device stay within budget."""
    seq, fits = start, 0
    while seq <= limit and step_memory(seq, context, form)["total"] <= budget:
        fits, seq = seq, seq * 2
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--context", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--form", choices=attention.FORMS, default="all-gather")
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    rows = []
    for seq in args.seq:
        base = None
        for context in args.context:
            temp = attention_temp(seq, context, args.form)
            base = temp if context == 1 else base
            step = step_memory(seq, context, args.form)
            rows.append({"seq": seq, "context": context, "attention_temp": temp,
                         "attention_ratio": temp / base if base else None,
                         "step_temp": step["temp"], "step_total": step["total"]})
            print(json.dumps(rows[-1]), flush=True)
    budget = args.budget_mib * 2**20
    widest = max(args.context)
    fits = {f"context={c}": longest_fitting(c, args.form, budget) for c in sorted({1, widest})}
    print(json.dumps({"model": "tiny", "form": args.form, "batch": 1, "budget_mib": args.budget_mib,
                      "longest_seq_fitting": fits}))


if __name__ == "__main__":
    main()

"""jaxpar's train step against the step a user would write by hand (issue 16): paired step times, compile time.

The hand-written step is a plain `jax.jit` with `NamedSharding` in/out shardings
and the state donated: `value_and_grad` of the same Flax model on parameters
cast to bf16 at use, then optax's AdamW on the fp32 parameters. Its shardings
are jaxpar's own rule specs (what the user's logical-axis rules would give),
the batch split over `data`; GSPMD places every collective. Both steps start
from the same parameters and their losses are compared, so the two compute
the same thing.

Timing on a shared machine drifts, so the two run interleaved: each round
times a few steps of one, then of the other (alternating which goes first),
per layout; the figure is the median over rounds of jaxpar's / hand-written
median step time, with the range. Compile figures: the lower and compile
seconds of each, how many times jaxpar traces the model's loss per compile,
and how many XLA compiles jaxpar's first step runs.

    python benchmarks/handwritten.py [--rounds 5] [--steps 4] [--layouts data=8 data=2,tensor=4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.models.llama import Llama, LlamaConfig  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.parallel.stack import REMAT  # noqa: E402
from jaxpar.train.state import init_state  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

# MaxText's llama2 block of issue 16 scaled down to run in seconds on two CPU cores (vocab 32000 -> 4096).
CONFIG = LlamaConfig(vocab=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, d_ff=1024,
                     seq_len=128, tie_embeddings=False)
BATCH = 16


def make_batch(step: int, config: LlamaConfig = CONFIG, batch_size: int = BATCH) -> dict:
    """The synthetic batch of a step, on host: the same for every framework given the same step."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, config.vocab, (batch_size, config.seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class Compiles:
    """How many XLA backend compiles run while inside (jax's monitoring event for each)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, name, _seconds, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def compile_jaxpar(plan: Plan, config: LlamaConfig, batch: dict, optimizer=None, compiles: Compiles | None = None):
    """jaxpar's step for `config` on `plan`, compiled for `batch`: model, state, the compiled step, its loss
    function and traces, figures (lower and compile seconds; with `compiles`, the XLA compiles they ran)."""
    optimizer = optimizer or optax.adamw(1e-3)
    model, state = init_state(lambda: Llama(config, nnx.Rngs(0)), optimizer, plan)
    traces = []

    def loss_fn(module, b):
        traces.append(1)
        return module(b)

    began, before = time.perf_counter(), compiles.count if compiles is not None else 0
    lowered = make_train_step(model, loss_fn, optimizer, plan).lower(state, batch)
    lowered_s = time.perf_counter() - began
    compiled = lowered.compile()
    compile_s = time.perf_counter() - began - lowered_s
    figures = {"lower_s": round(lowered_s, 2), "compile_s": round(compile_s, 2)}
    if compiles is not None:
        figures["xla_compiles"] = compiles.count - before
    return model, state, compiled, loss_fn, traces, figures


def jaxpar_step(mesh: str, compiles: Compiles):
    """jaxpar's compiled step, its initial state, and what compiling it took."""
    plan = Plan.create(mesh, precision="bf16", remat="none")
    optimizer = optax.adamw(1e-3)
    batch = jax.device_put(make_batch(0), plan.sharding(plan.batch_spec(2)))
    model, state, compiled, loss_fn, traces, figures = compile_jaxpar(plan, CONFIG, batch, optimizer, compiles)
    figures["loss_traces"] = len(traces)
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    began, before, traced = time.perf_counter(), compiles.count, len(traces)
    first = make_train_step(model, loss_fn, optimizer, plan)  # a run's path: jit on the first call
    jax.block_until_ready(first(fresh, batch))
    figures |= {"first_call_s": round(time.perf_counter() - began, 2), "first_call_xla_compiles":
                compiles.count - before, "first_call_loss_traces": len(traces) - traced}
    return plan, model, state, metrics_loss(compiled), figures


def metrics_loss(compiled):
    """A jaxpar compiled step as (state, batch) -> (state, loss), the hand-written step's signature."""
    def run(s, b):
        s, metrics = compiled(s, b)
        return s, metrics["loss"]

    return run


def handwritten_step(plan: Plan, model, params, batch: dict, remat: str = "none"):
    """The step a user writes: jit + NamedSharding, bf16 casts of the fp32 parameters at use, AdamW.

    `remat` names a `jaxpar.parallel.stack.REMAT` policy, applied by `jax.checkpoint` around each layer as a user
    would (the model's `remat` hook), so both steps recompute the same.
    """
    optimizer = optax.adamw(1e-3)
    param_sh = plan.shardings(plan.param_specs(model.logical))
    params = jax.device_put(jax.tree.map(jnp.copy, params), param_sh)
    replicated = plan.sharding(jax.sharding.PartitionSpec())
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, jax.eval_shape(optimizer.init, params), param_sh,
                                   transform_non_params=lambda _: replicated,
                                   is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)  # moments sharded like the parameters
    batch_sh = plan.sharding(plan.batch_spec(2))
    policy = REMAT[remat]
    wrap = (lambda f: f) if policy is None else functools.partial(jax.checkpoint, policy=policy)

    def loss(p, b):
        out = model.merge(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p))(b, remat=wrap)
        return out[0] if isinstance(out, tuple) else out  # the model returns (loss, metrics)

    def step(state, b):
        p, o = state
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, o = optimizer.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), value

    began = time.perf_counter()
    jitted = jax.jit(step, in_shardings=((param_sh, opt_sh), batch_sh), out_shardings=((param_sh, opt_sh), None),
                     donate_argnums=0)
    compiled = jitted.lower((params, opt_state), jax.device_put(batch, batch_sh)).compile()
    return (params, opt_state), compiled, round(time.perf_counter() - began, 2)


def timed(run, state, place, first: int, steps: int, batch=make_batch):
    """(state after, median seconds per step, losses, seconds) of `steps` steps from batch `first`.

    `place` puts a host batch on the devices; `batch(step)` makes it.
    """
    seconds, losses = [], []
    for i in range(first, first + steps):
        b = place(batch(i))
        began = time.perf_counter()
        state, loss = run(state, b)
        losses.append(float(jax.block_until_ready(loss)))
        seconds.append(time.perf_counter() - began)
    return state, statistics.median(seconds), losses, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", nargs="*", default=["data=8", "data=2,tensor=4"])
    args = parser.parse_args()
    compiles = Compiles()
    setups = {}
    for mesh in args.layouts:
        plan, model, state, ours, figures = jaxpar_step(mesh, compiles)
        hand_state, hand, hand_compile_s = handwritten_step(plan, model, state.params, make_batch(0))
        setups[mesh] = {"plan": plan, "runs": {"jaxpar": [ours, state], "hand": [lambda s, b, c=hand: c(s, b),
                                                                                   hand_state]},
                        "figures": {**figures, "handwritten_lower_and_compile_s": hand_compile_s},
                        "times": {"jaxpar": [], "hand": []}, "losses": {"jaxpar": [], "hand": []}}
    for r in range(args.rounds):
        for mesh, s in setups.items():
            order = ("jaxpar", "hand") if r % 2 == 0 else ("hand", "jaxpar")
            for name in order:
                run, state = s["runs"][name]
                first = 1 + r * args.steps  # both see the same batches, in the same order
                place = functools.partial(jax.device_put, device=s["plan"].sharding(s["plan"].batch_spec(2)))
                state, seconds, losses, _ = timed(run, state, place, first, args.steps)
                s["runs"][name][1] = state
                s["times"][name].append(seconds)
                s["losses"][name] += losses
    for mesh, s in setups.items():
        ratios = [a / b for a, b in zip(s["times"]["jaxpar"], s["times"]["hand"])]
        ours, hand = np.array(s["losses"]["jaxpar"]), np.array(s["losses"]["hand"])
        print(json.dumps({
            "benchmark": "handwritten", "mesh": mesh, "jax": jax.__version__, "rounds": args.rounds,
            "steps_per_round": args.steps,
            "jaxpar_s": [round(t, 4) for t in s["times"]["jaxpar"]], "handwritten_s": [round(t, 4) for t in
                                                                                      s["times"]["hand"]],
            "ratios": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "max_loss_relative_difference": float(np.max(np.abs(ours / hand - 1))),
            "load_average": os.getloadavg(), **s["figures"],
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Tensor (and sequence) parallelism figures as JSON, for tensor = 1, 2, 4, 8:

- parameter bytes per device against 1/t of the split weights plus the replicated norms;
- collective traffic per block (jaxpar.planner.inspect's ring traffic of the ops in the layer scans)
  against Megatron's 8·b·s·h·(t−1)/t elements per layer per device, forward and backward;
- activation memory per layer (XLA's temp bytes, differenced between 2L and L layers)
  with and without sequence parallelism, next to Korthikanti et al.'s sbh(10 + 24/t + 5as/(ht))
  and (sbh/t)(34 + 5as/h), which assume 16-bit activations, dropout and a 4h GeLU MLP;
- step time of jaxpar's step (both layer forms) against a hand-written jax.jit with the same
  NamedShardings on the parameters and no further annotations.

    python benchmarks/tensor_parallel.py [--model small] [--layers 4] [--batch-size 8] [--seq-len 128] [--tensor 1 2 4 8]
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.planner import inspect  # noqa: E402
from jaxpar.models.llama import CONFIGS, Llama  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.core.rules import mesh_axes_of  # noqa: E402
from jaxpar.train.state import abstract_state, describe, init_state, state_specs  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402

OPTIMIZER = optax.adamw(1e-3)


def loss_fn(module, batch):
    return module(batch)


def plan_for(tensor: int, **options) -> Plan:
    return Plan.create(f"tensor={tensor}", devices=jax.devices()[:tensor], **options)


def token_batch(config, batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    draw = lambda: jnp.asarray(rng.integers(0, config.vocab, (batch, config.seq_len)), jnp.int32)  # noqa: E731
    return {"inputs": draw(), "targets": draw()}


def param_bytes(model, plan: Plan, state) -> dict:
    """Bytes of parameters on device 0, and what 1/t of every split weight plus the replicated rest makes."""
    on_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.params))
    specs = jax.tree.leaves(plan.param_specs(model.logical), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    leaves = jax.tree.leaves(model.logical, is_leaf=lambda x: hasattr(x, "names"))
    expected = 0
    for leaf, spec in zip(leaves, specs):
        ways = math.prod(plan.shape[a] for entry in spec for a in mesh_axes_of(entry))
        expected += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // ways
    return {"total": model.param_bytes(), "per_device": on_device, "expected_per_device": expected}


def block_traffic(compiled, plan: Plan, layers: int) -> float:
    """Ring traffic per device of the collectives over tensor inside the layer scans, per layer."""
    ops = inspect.collective_ops(compiled, plan.mesh)
    return sum(op.traffic * op.count for op in ops if "tensor" in op.axes and op.count == layers) / layers


def temp_per_layer(config, plan: Plan, batch: dict, compiled) -> float:
    """Activation bytes one more layer costs: XLA's temp memory at 2L layers minus at L (`compiled`), over L."""
    model = describe(lambda: Llama(dataclasses.replace(config, n_layers=2 * config.n_layers), nnx.Rngs(0)))
    step = make_train_step(model, loss_fn, OPTIMIZER, plan)
    doubled = step.lower(abstract_state(model, OPTIMIZER, plan), batch).compile()
    return (inspect.memory(doubled)["temp"] - inspect.memory(compiled)["temp"]) / config.n_layers


def korthikanti(config, batch: int, tensor: int) -> dict:
    s, b, h, a = config.seq_len, batch, config.d_model, config.n_heads
    return {
        "tensor": s * b * h * (10 + 24 / tensor + 5 * a * s / (h * tensor)),
        "tensor_sequence": s * b * h / tensor * (34 + 5 * a * s / h),
    }


def seconds_per_step(steps: dict, batch, rounds: int) -> dict:
    """Median seconds per step of each compiled step, timed round-robin so load drifts hit all alike.

    `steps` maps a name to (compiled step, its own state); the first round warms up.
    """
    states = {name: state for name, (_, state) in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(rounds + 1):
        for name, (step, _) in steps.items():
            began = time.perf_counter()
            states[name], metrics = step(states[name], batch)
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def handwritten_step(model, plan: Plan):
    """What a user would write without jaxpar: jax.jit, NamedSharding on parameters, GSPMD does the rest."""
    shardings = plan.shardings(state_specs(model, OPTIMIZER, plan))
    batch_sharding = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: model.merge(p)(batch)[0])(state.params)
        updates, opt_state = OPTIMIZER.update(grads, state.opt_state, state.params)
        return dataclasses.replace(state, params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                                   step=state.step + 1), {"loss": loss}

    return jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0)


def fresh(state):
    """A copy of a state with the same shardings (steps donate theirs)."""
    return jax.tree.map(lambda x: x.copy(), state)


def measure(config, tensor: int, batch_size: int, rounds: int) -> dict:
    batch = token_batch(config, batch_size)
    result = {"tensor": tensor}
    timed = {}
    for form in ("annotation", "explicit"):
        plan = plan_for(tensor, tensor_form=form)
        model, state = init_state(lambda: Llama(config, nnx.Rngs(0)), OPTIMIZER, plan)
        compiled = make_train_step(model, loss_fn, OPTIMIZER, plan).lower(state, batch).compile()
        if form == "annotation":
            result["param_bytes"] = param_bytes(model, plan, state)
            traffic = {"tensor": block_traffic(compiled, plan, config.n_layers)}
            temp = {"tensor": temp_per_layer(config, plan, batch, compiled)}
            timed["handwritten_jit"] = (handwritten_step(model, plan).lower(state, batch).compile(), fresh(state))
        timed[f"jaxpar_{form}"] = (compiled, state)
    if tensor > 1:
        sp_plan = plan_for(tensor, tensor_form="explicit", sequence_parallel=True)
        sp_step = make_train_step(model, loss_fn, OPTIMIZER, sp_plan)
        compiled = sp_step.lower(abstract_state(model, OPTIMIZER, sp_plan), batch).compile()
        traffic["tensor_sequence"] = block_traffic(compiled, sp_plan, config.n_layers)
        temp["tensor_sequence"] = temp_per_layer(config, sp_plan, batch, compiled)
    times = seconds_per_step(timed, batch, rounds)
    megatron = 8 * batch_size * config.seq_len * config.d_model * (tensor - 1) / tensor * 4
    result.update({
        "block_traffic_bytes": traffic,
        "megatron_bytes": megatron,
        "traffic_over_megatron": {k: v / megatron for k, v in traffic.items()} if tensor > 1 else None,
        "temp_bytes_per_layer": temp,
        "korthikanti_bytes_per_layer": korthikanti(config, batch_size, tensor),
        "step_time_s": times,
        "step_time_over_handwritten": {k: v / times["handwritten_jit"] for k, v in times.items() if k != "handwritten_jit"},
    })
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps of each variant, round-robin")
    parser.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    # kv heads must split over tensor=8 as well
    config = dataclasses.replace(CONFIGS[args.model], n_layers=args.layers, seq_len=args.seq_len, n_kv_heads=8)
    results = [measure(config, t, args.batch_size, args.rounds) for t in args.tensor]
    print(json.dumps({"benchmark": "tensor_parallel", "model": args.model, "config": dataclasses.asdict(config),
                      "batch_size": args.batch_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()

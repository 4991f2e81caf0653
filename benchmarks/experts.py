"""Expert-parallelism figures as JSON, at a fixed global batch on 8 devices:

- for expert = 1, 2, 4, 8 (data = 8 / expert): the all-to-all calls and bytes per device per step,
  read from the compiled step, against 4 per MoE layer of k · tokens per device · d_model ·
  capacity factor · bytes per element (dispatch and combine, forward and backward), and the
  part of them that leaves the device ((expert - 1) / expert); the expert weights' bytes per
  device; the median step time;
- the dropped-token fraction at capacity factor 1.0 and 1.25 (and dropless), at the first step and
  after training, with the load-balancing loss that pushes the router towards even loads;
- one dropless MoE layer's compiled temp (forward + backward, XLA's memory analysis, nothing run) by
  `moe_kernel` (buffered, tiled; ragged with --ragged; and what auto chose) on one device, against the routed
  rows' activations tokens x k x (d + f) x bytes (issue 57: E=128, k=8, d=512, f=256, 4,096 tokens, fp32).
  `--target h100x8` compiles it for a GPU target instead (`jaxpar.core.target`; JAX_PLATFORMS=cpu, the CUDA
  plugin): 8 devices of 4,096 tokens each, the temp per device. Like every target compile (`gpu_profile.DEVICELESS`)
  it sorts with XLA's own sort, not CUB's radix sort, which needs a GPU to size its scratch space.

    python benchmarks/experts.py [--model moe-tiny] [--batch-size 16] [--seq-len 64] [--steps 5] [--train-steps 20]
    python benchmarks/experts.py --layer-only [--ragged] [--target h100x8]    # the layer's memory by kernel only
"""

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.data import tokens as data_lib  # noqa: E402
from jaxpar.planner import inspect  # noqa: E402
from jaxpar.models.moe import CONFIGS, MoeLlama  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.train.state import init_state  # noqa: E402
from jaxpar.train.step import make_train_step  # noqa: E402
from jaxpar.run.training import TrainConfig, make_optimizer  # noqa: E402


def setup(config, plan: Plan, batch_size: int, train_steps: int):
    optimizer = make_optimizer(TrainConfig(steps=max(train_steps, 2), batch_size=batch_size, seq_len=config.seq_len))
    model, state = init_state(lambda: MoeLlama(config, nnx.Rngs(0)), optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    batches = data_lib.Batches(data_lib.default_corpus(), batch_size, config.seq_len, seed=0)
    sharding = plan.sharding(plan.batch_spec(2))
    return state, step, lambda i: data_lib.global_batch(batches, i, sharding)


def expert_weight_bytes(state) -> int:
    """Bytes of the experts' weights on device 0."""
    moe = state.params["blocks"]["moe"]
    return sum(moe[k].addressable_shards[0].data.nbytes for k in ("expert_gate", "expert_up", "expert_down"))


def scaling_row(config, expert: int, batch_size: int, steps: int) -> dict:
    plan = Plan.create(f"data={8 // expert},expert={expert}")
    state, step, batch = setup(config, plan, batch_size, steps)
    compiled = step.lower(state, batch(0)).compile()
    all_to_all = [r for r in inspect.collectives(compiled, plan.mesh) if r["kind"] == "all-to-all"]
    tokens = batch_size * config.seq_len // 8
    factor = config.n_experts / config.top_k if config.dropless else config.capacity_factor
    per_call = config.top_k * tokens * config.d_model * factor * np.dtype(config.param_dtype).itemsize
    weights = expert_weight_bytes(state)
    times = []
    for i in range(steps + 1):
        began = time.perf_counter()
        state, metrics = step(state, batch(i))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - began)
    return {
        "mesh": {"data": 8 // expert, "expert": expert},
        "all_to_all_calls": sum(r["count"] for r in all_to_all),
        "all_to_all_bytes": sum(r["bytes"] for r in all_to_all),
        "all_to_all_bytes_formula": 0 if expert == 1 else 4 * config.n_moe_layers * per_call,
        "all_to_all_traffic": sum(r["traffic"] for r in all_to_all),  # (expert - 1) / expert of it leaves the device
        "expert_weight_bytes_per_device": weights,
        "step_time_s": statistics.median(times[1:]),
    }


def drops_row(config, capacity: float | None, batch_size: int, train_steps: int) -> dict:
    cfg = dataclasses.replace(config, dropless=True) if capacity is None else \
        dataclasses.replace(config, capacity_factor=capacity)
    state, step, batch = setup(cfg, Plan.create("data=2,expert=4"), batch_size, train_steps)
    rows = []
    for i in range(train_steps):
        state, metrics = step(state, batch(i))
        rows.append({k: np.asarray(v) for k, v in jax.device_get(metrics).items()})
    return {
        "capacity_factor": "dropless" if capacity is None else capacity,
        "capacity_per_group": cfg.moe.capacity(cfg.moe.group(cfg.seq_len)),
        "dropped_fraction_first_step": float(rows[0]["dropped_fraction"]),
        "dropped_fraction_last_step": float(rows[-1]["dropped_fraction"]),
        "load_balance_loss_first_step": float(rows[0]["load_balance_loss"]),
        "load_balance_loss_last_step": float(rows[-1]["load_balance_loss"]),
        "expert_share_last_step": [round(float(v), 4) for v in rows[-1]["expert_share"]],
        "loss_first_step": float(rows[0]["loss"]),
        "loss_last_step": float(rows[-1]["loss"]),
    }


LAYER = {"n_experts": 128, "top_k": 8, "d_model": 512, "d_ff": 256, "tokens": 4096}


def layer_memory_row(kernel: str, shape: dict, target: str | None = None) -> dict:
    """Compiled temp bytes per device of value_and_grad of one dropless layer (params and input) under
    moe_kernel=`kernel` ("auto": the kernel auto chose is reported), on one CPU device or a target's 8."""
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    from jaxpar.core import device_facts, gpu_profile  # noqa: PLC0415
    from jaxpar.parallel import expert_kernels, experts  # noqa: PLC0415

    e, k, d, f, tokens = (shape[n] for n in ("n_experts", "top_k", "d_model", "d_ff", "tokens"))
    cfg = experts.MoEConfig(e, top_k=k, dropless=True)
    p = {"router": jax.ShapeDtypeStruct((d, e), np.float32), "expert_gate": jax.ShapeDtypeStruct((e, d, f), np.float32),
         "expert_up": jax.ShapeDtypeStruct((e, d, f), np.float32),
         "expert_down": jax.ShapeDtypeStruct((e, f, d), np.float32)}
    devices = 8 if target else 1
    x = jax.ShapeDtypeStruct((devices, tokens, d), np.float32)

    def objective(p, x):
        y, stats = experts.moe_ffn(p, x, cfg)
        return (y * y).sum() + stats["load_balance_loss"]

    plan = Plan.create(f"data={devices}", target=target, moe_kernel=kernel) if target else \
        Plan.create("data=1", devices=jax.devices()[:1], moe_kernel=kernel)
    whole, rows = NamedSharding(plan.mesh, PartitionSpec()), NamedSharding(plan.mesh, PartitionSpec("data"))
    options = gpu_profile.compile_options(device_facts.of_mesh(plan.mesh)) if target else {}
    with plan.activate():
        fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)), in_shardings=(whole, rows),
                     out_shardings=(whole, (whole, rows)))
        compiled, _, _ = gpu_profile.compile_with(fn.lower(p, x), options)
    temp = compiled.memory_analysis().temp_size_in_bytes
    routed = tokens * k * (d + f) * 4
    chosen = expert_kernels.choose(True, plan)
    grads = 3 * e * d * f * 4 if target else 0  # data=8 sums the replicated experts' gradient: its buffer is temp
    return {"kernel": kernel, **({"chosen": chosen[0], "why": chosen[1]} if kernel == "auto" else {}), **shape,
            "temp_bytes": temp, "routed_rows_bytes": routed, "temp_over_routed": round(temp / routed, 3),
            **({"expert_weight_grad_bytes": grads, "temp_less_weight_grads_over_routed":
                round((temp - grads) / routed, 3)} if target else {})}


def sent_rows_bytes(hlo: str) -> list[int]:
    """Bytes of the operand each ragged-all-to-all of a compiled module sends from: its first operand's shape
    (XLA:GPU's async start names it first in its type, ((operand, output, offsets...), output))."""
    import re  # noqa: PLC0415

    shapes = dict(re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+\[[0-9,]*\])", hlo, re.M))
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    out = []
    for line in hlo.splitlines():
        start = re.search(r"=\s*\(\((\w+\[[0-9,]*\]).*ragged-all-to-all-start\(", line)
        plain = re.search(r"ragged-all-to-all\(%?([\w.\-]+)", line)
        if not (start or plain):
            continue
        dtype, dims = re.match(r"(\w+)\[([0-9,]*)\]", start.group(1) if start else shapes[plain.group(1)]).groups()
        out.append(int(np.prod([int(n) for n in dims.split(",") if n])) * sizes[dtype])
    return out


def exchange_row(shape: dict, target: str) -> dict:
    """One dropless layer (tiled) with its experts over expert=8 compiled for `target`: the exchange chosen, and the
    bytes each ragged-all-to-all sends from beside the routed rows' tokens x k x d x 4 per device."""
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    from jaxpar.core import device_facts, gpu_profile  # noqa: PLC0415
    from jaxpar.parallel import expert_exchange, experts  # noqa: PLC0415

    e, k, d, f, tokens = (shape[n] for n in ("n_experts", "top_k", "d_model", "d_ff", "tokens"))
    cfg = experts.MoEConfig(e, top_k=k, dropless=True)
    plan = Plan.create("expert=8", target=target, moe_kernel="tiled")
    whole, split = NamedSharding(plan.mesh, PartitionSpec()), NamedSharding(plan.mesh, PartitionSpec("expert"))
    p = {"router": jax.ShapeDtypeStruct((d, e), np.float32)}
    p |= {n: jax.ShapeDtypeStruct((e, *s), np.float32, sharding=split)
          for n, s in (("expert_gate", (d, f)), ("expert_up", (d, f)), ("expert_down", (f, d)))}
    x = jax.ShapeDtypeStruct((8, tokens, d), np.float32)

    def objective(p, x):
        y, stats = experts.moe_ffn(p, x, cfg)
        return (y * y).sum() + stats["load_balance_loss"]

    specs = {n: whole if n == "router" else split for n in p}
    options = gpu_profile.compile_options(device_facts.of_mesh(plan.mesh))
    with plan.activate():
        fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)), in_shardings=(specs, split),
                     out_shardings=(whole, (specs, split)))
        compiled, _, _ = gpu_profile.compile_with(fn.lower(p, x), options)
    routed = tokens * k * d * 4
    sent = sent_rows_bytes(compiled.as_text())
    return {"target": target, "mesh": "expert=8", **shape, "exchange": expert_exchange.choose(plan, "expert"),
            "ragged_all_to_all_operand_bytes": sent, "routed_rows_bytes": routed,
            "dispatch_over_routed": [round(b / routed, 4) for b in sent if b <= routed],
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="moe-tiny", choices=sorted(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per mesh")
    parser.add_argument("--train-steps", type=int, default=20, help="steps of the dropped-token runs")
    parser.add_argument("--layer-only", action="store_true", help="only the MoE layer's memory by kernel")
    parser.add_argument("--ragged", action="store_true", help="the layer's memory under moe_kernel=ragged as well")
    parser.add_argument("--target", help="compile the layer for a GPU target (h100x8, ...; with --layer-only)")
    args = parser.parse_args()
    if args.target and not args.layer_only:
        parser.error("--target compiles the layer only: add --layer-only")
    kernels = ["buffered", "tiled", "auto"] + (["ragged"] if args.ragged else [])
    layer = [layer_memory_row(kernel, LAYER, args.target) for kernel in kernels]
    if args.layer_only:
        where = {"target": args.target} if args.target else {"platform": jax.devices()[0].platform}
        exchange = {"exchange": exchange_row(LAYER, args.target)} if args.target else {}
        print(json.dumps({**where, "layer_memory": layer, **exchange}, indent=1))
        return
    config = dataclasses.replace(CONFIGS[args.model], seq_len=args.seq_len)
    report = {
        "model": args.model,
        "global_batch": args.batch_size,
        "seq_len": args.seq_len,
        "n_experts": config.n_experts,
        "top_k": config.top_k,
        "moe_layers": config.n_moe_layers,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "scaling": [scaling_row(config, expert, args.batch_size, args.steps) for expert in (1, 2, 4, 8)],
        "drops": [drops_row(config, capacity, args.batch_size, args.train_steps) for capacity in (1.0, 1.25, None)],
        "layer_memory": layer,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

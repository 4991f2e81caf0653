"""Expert parallelism: the all-to-all MoE layer and model equal a loop over experts on one device.

The reference here routes, drops and combines on its own, looping over the
experts and running each one on every token (masked), so it shares nothing with
jaxpar.parallel.experts but the definitions: top-k of the router softmax, choice-major
priority within a group, capacity ceil(k * group * factor / E).
"""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from helpers import batches, copy_state, max_relative_error, single_device_plan
from jaxpar.parallel import experts
from jaxpar.planner import inspect
from jaxpar.pipeline import executor as pipeline
from jaxpar.cli import main
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.moe import MoeLlama, MoeLlamaConfig
from jaxpar.core.plan import Plan
from jaxpar.train.state import describe, init_state, place_state
from jaxpar.train.step import make_train_step

E, D, F = 8, 32, 32
MESHES = ["expert=2", "expert=4", "expert=8", "data=2,expert=4"]
MODES = {
    "capacity1.0-top2": experts.MoEConfig(E, top_k=2, capacity_factor=1.0),
    "dropless-top2": experts.MoEConfig(E, top_k=2, dropless=True),
    "capacity1.0-top1-group8-zloss": experts.MoEConfig(E, top_k=1, capacity_factor=1.0, group_size=8,
                                                       router_z_coef=1e-3),
}
MODEL = MoeLlamaConfig(vocab=256, d_model=D, n_layers=2, moe_every=1, n_heads=2, n_kv_heads=2, head_dim=16,
                       d_ff=64, expert_d_ff=F, n_experts=E, seq_len=16, capacity_factor=1.0)
DENSE = LlamaConfig(vocab=256, d_model=D, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64, seq_len=16)


def plan_for(mesh: str, **options) -> Plan:
    """A plan on exactly as many devices as `mesh` names."""
    sizes = [int(part.split("=")[1]) for part in mesh.split(",")]
    return Plan.create(mesh, devices=jax.devices()[: math.prod(sizes)], **options)


def reference_moe(p, x, cfg: experts.MoEConfig):
    """Single-device MoE by a loop over experts: each runs on all tokens, masked to its kept assignments."""
    batch, seq, d = x.shape
    group = cfg.group_size or seq
    capacity = cfg.capacity(group)
    tokens = x.reshape(-1, group, d)
    logits = jnp.einsum("gtd,de->gte", tokens.astype(jnp.float32), p["router"].astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, choice = jax.lax.top_k(probs, cfg.top_k)
    gates = top_probs if cfg.top_k == 1 else top_probs / top_probs.sum(-1, keepdims=True)
    y = jnp.zeros(tokens.shape, jnp.float32)
    kept_count, load = 0, []
    for e in range(cfg.n_experts):
        wanted = choice == e  # [groups, tokens, k]
        in_priority = jnp.swapaxes(wanted, 1, 2).reshape(wanted.shape[0], -1)  # all first choices, then second
        rank = jnp.cumsum(in_priority, axis=-1) - 1
        kept = jnp.swapaxes((in_priority & (rank < capacity)).reshape(wanted.shape[0], cfg.top_k, group), 1, 2)
        weight = jnp.sum(jnp.where(kept, gates, 0.0), axis=-1)
        hidden = jax.nn.silu(tokens @ p["expert_gate"][e]) * (tokens @ p["expert_up"][e])
        y = y + weight[..., None] * (hidden @ p["expert_down"][e])
        kept_count += jnp.sum(kept)
        load.append(jnp.mean(wanted, axis=(1, 2)))
    load = jnp.stack(load, axis=-1)  # [groups, E]
    balance = cfg.n_experts * jnp.sum(load * probs.mean(axis=1), axis=-1)
    stats = {
        "load_balance_loss": cfg.load_balance_coef * balance.mean(),
        "dropped_fraction": 1.0 - kept_count / (tokens.shape[0] * group * cfg.top_k),
        "expert_share": load.mean(axis=0),
    }
    if cfg.router_z_coef:
        stats["router_z_loss"] = cfg.router_z_coef * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y.reshape(batch, seq, d).astype(x.dtype), stats


def layer_params(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        "router": jax.random.normal(keys[0], (D, E)) * D**-0.5,
        "expert_gate": jax.random.normal(keys[1], (E, D, F)) * D**-0.5,
        "expert_up": jax.random.normal(keys[2], (E, D, F)) * D**-0.5,
        "expert_down": jax.random.normal(keys[3], (E, F, D)) * F**-0.5,
    }


def layer_objective(layer, cfg, p, x, probe):
    """A scalar that depends on every output and on the auxiliary losses (so on the router)."""
    y, stats = layer(p, x, cfg)
    aux = stats["load_balance_loss"] + stats.get("router_z_loss", 0.0)
    return jnp.sum(y * probe) + aux, stats


def run_layer(layer, cfg, plan, p, x, probe):
    """Objective, statistics and gradients (params, x) of the layer under `plan`."""
    experts_spec = P(plan.rules["experts"])
    p = {k: jax.device_put(v, plan.sharding(P() if k == "router" else experts_spec)) for k, v in p.items()}
    x, probe = (jax.device_put(a, plan.sharding(plan.batch_spec(3))) for a in (x, probe))
    fn = jax.value_and_grad(functools.partial(layer_objective, layer, cfg), argnums=(0, 1), has_aux=True)
    with plan.activate():
        return jax.device_get(jax.jit(fn)(p, x, probe))


@functools.cache
def layer_inputs():
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (8, 16, D))
    probe = jax.random.normal(keys[1], (8, 16, D))
    return layer_params(), x, probe


@functools.cache
def layer_reference(mode: str):
    return run_layer(reference_moe, MODES[mode], single_device_plan(), *layer_inputs())


LAYER_CASES = [(mesh, mode) for mesh in MESHES for mode in ("capacity1.0-top2", "dropless-top2")]
LAYER_CASES += [("data=2,expert=4", "capacity1.0-top1-group8-zloss"), ("expert=8", "capacity1.0-top1-group8-zloss")]


@pytest.mark.parametrize("mesh,mode", LAYER_CASES)
def test_expert_parallel_layer_matches_loop_over_experts(mesh, mode):
    cfg = MODES[mode]
    (ref_value, ref_stats), ref_grads = layer_reference(mode)
    (value, stats), grads = run_layer(experts.moe_ffn, cfg, plan_for(mesh), *layer_inputs())
    if cfg.dropless:
        assert float(stats["dropped_fraction"]) == 0.0
    else:
        assert 0.05 < float(ref_stats["dropped_fraction"]) < 0.5  # drops do happen at capacity 1.0
    assert abs(value / ref_value - 1) <= 1e-5
    assert max_relative_error(stats, ref_stats) <= 1e-6
    assert max_relative_error(grads, ref_grads) <= 1e-5


def test_routing_drops_second_choices_before_first_choices():
    cfg = experts.MoEConfig(4, top_k=2, capacity_factor=1.0)  # 4 tokens -> 2 slots per expert
    logits = jnp.log(jnp.array([
        [0.6, 0.3, 0.05, 0.05],  # 1st e0, 2nd e1: dropped, e1 is full with the first choices of t1, t2
        [0.1, 0.6, 0.25, 0.05],  # 1st e1, 2nd e2
        [0.2, 0.5, 0.05, 0.25],  # 1st e1, 2nd e3
        [0.6, 0.1, 0.1, 0.2],  # 1st e0, 2nd e3
    ]))
    routing, stats = experts.route(logits, cfg, cfg.capacity(4))
    kept = np.asarray(routing.slot) < 4 * 2
    np.testing.assert_array_equal(np.asarray(routing.expert), [[0, 1], [1, 2], [1, 3], [0, 3]])
    np.testing.assert_array_equal(kept, [[True, False], [True, True], [True, True], [True, True]])
    assert float(stats["dropped"]) == pytest.approx(1 / 8)
    np.testing.assert_allclose(np.asarray(routing.gate).sum(-1), 1.0, rtol=1e-6)


def test_load_balancing_loss_is_alpha_when_balanced_and_alpha_times_e_when_collapsed():
    cfg = experts.MoEConfig(4, top_k=1, load_balance_coef=0.01)
    balanced = jnp.eye(4).repeat(2, axis=0) * 1e-3  # each expert first for two tokens, probs ~ uniform
    collapsed = jnp.zeros((8, 4)).at[:, 0].set(30.0)  # everything to expert 0 with probability ~1
    for logits, expected in ((balanced, 0.01), (collapsed, 0.04)):
        _, stats = experts.route(logits, cfg, cfg.capacity(8))
        loss = experts.layer_statistics(jax.tree.map(lambda v: v[None], stats), cfg)["load_balance_loss"]
        assert float(loss) == pytest.approx(expected, rel=1e-3)


def test_capacity_formula():
    assert experts.MoEConfig(8, top_k=2, capacity_factor=1.0).capacity(32) == 8
    assert experts.MoEConfig(8, top_k=2, capacity_factor=1.25).capacity(32) == 10
    assert experts.MoEConfig(8, top_k=1, capacity_factor=1.0).capacity(12) == 2  # ceil(1.5)
    assert experts.MoEConfig(8, top_k=2, dropless=True).capacity(32) == 32


# -- the whole model ---------------------------------------------------------------------------

STEPS = 3


def recording_sgd(lr: float) -> optax.GradientTransformation:
    """SGD whose state keeps the first step's gradients: one compiled step gives losses and gradients."""

    def init(params):
        return jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        count, first = state
        first = jax.tree.map(lambda f, g: jnp.where(count == 0, g, f), first, grads)
        return jax.tree.map(lambda g: -lr * g, grads), (count + 1, first)

    return optax.GradientTransformation(init, update)


OPTIMIZER = recording_sgd(0.5)
DATA = batches(batch_size=8, seq_len=16)
CONFIGS = {
    "capacity": MODEL,  # two MoE blocks, capacity factor 1.0
    "dropless": dataclasses.replace(MODEL, dropless=True, moe_every=2),  # a dense block, then a MoE block
    "dropless-every": dataclasses.replace(MODEL, dropless=True),  # two dropless MoE blocks (one per pipeline stage)
}


@functools.cache
def initial(mode: str):
    cfg = CONFIGS[mode]
    model, state = init_state(lambda: MoeLlama(cfg, nnx.Rngs(0)), OPTIMIZER, single_device_plan())
    return model, copy_state(state)


@functools.cache
def run_model(mode: str, mesh: str, reference: bool = False, **options):
    """Losses of STEPS steps, first-step gradients and metrics, and the compiled step, on `mesh`."""
    model, state = initial(mode)
    plan = plan_for(mesh, **dict(options))
    loss_fn = moe_reference_loss if reference else (lambda m, b: m(b))
    state = place_state(copy_state(state), model, OPTIMIZER, plan)
    step = make_train_step(model, loss_fn, OPTIMIZER, plan)
    compiled = step.lower(state, DATA[0]).compile()
    losses, first_metrics = [], None
    for i in range(STEPS):
        state, metrics = step(state, DATA[i])
        losses.append(float(metrics["loss"]))
        first_metrics = first_metrics or jax.device_get(metrics)
    return np.array(losses), jax.device_get(state.opt_state[1]), first_metrics, compiled, plan


def moe_reference_loss(module, batch):
    return module(batch, moe_layer=reference_moe)


def assert_matches_reference(mode: str, mesh: str, **options):
    ref_losses, ref_grads, ref_metrics, _, _ = run_model(mode, "data=1", reference=True)
    losses, grads, metrics, _, _ = run_model(mode, mesh, **options)
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(grads, ref_grads) <= 1e-5
    assert max_relative_error(metrics["expert_share"], ref_metrics["expert_share"]) <= 1e-6
    assert metrics["dropped_fraction"] == pytest.approx(ref_metrics["dropped_fraction"], abs=1e-7)
    assert (ref_metrics["dropped_fraction"] > 0.05) == (not CONFIGS[mode].dropless)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.parametrize("mode", ["capacity", "dropless"])
@pytest.mark.parametrize("mesh", MESHES)
def test_moe_model_matches_single_device_loop_over_experts(mesh, mode):
    assert_matches_reference(mode, mesh)


@pytest.mark.parametrize("mesh", ["expert=8", "data=2,expert=4"])
@pytest.mark.parametrize("mode", ["capacity", "dropless"])
def test_two_all_to_alls_per_moe_layer_each_way_of_the_expected_bytes(mesh, mode):
    cfg = CONFIGS[mode]
    _, _, _, compiled, plan = run_model(mode, mesh)
    ops = inspect.collective_ops(compiled, plan.mesh)
    all_to_alls = [op for op in ops if op.kind == "all-to-all"]
    assert {op.axes for op in all_to_alls} == {("expert",)}
    tokens_per_device = 8 * 16 // plan.axis_size("data", "expert")
    if cfg.dropless:  # the tiled kernel (auto on CPU) sends each (group, expert)'s int32 row count once, forward
        counts = [op for op in all_to_alls if op.bytes == tokens_per_device // 16 * E * 4]
        assert sum(op.count for op in counts) == cfg.n_moe_layers
        all_to_alls = [op for op in all_to_alls if op not in counts]
    assert sum(op.count for op in all_to_alls) == 4 * cfg.n_moe_layers  # dispatch + combine, forward + backward
    factor = E / cfg.top_k if cfg.dropless else cfg.capacity_factor
    expected = cfg.top_k * tokens_per_device * D * factor * 4  # k * tokens * d_model * capacity factor * fp32
    assert {op.bytes for op in all_to_alls} == {expected}


def all_gathers(compiled, plan: Plan) -> list:
    return sorted((op.axes, op.shapes) for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "all-gather")


def test_moe_step_all_gathers_nothing():
    _, _, _, compiled, plan = run_model("capacity", "expert=8")
    assert all_gathers(compiled, plan) == []


def test_moe_layers_add_no_all_gather_to_the_dense_step():
    """With data and expert, the step all-gathers only what the dense model's step on that mesh does."""
    _, _, _, compiled, plan = run_model("capacity", "data=2,expert=4")
    model, state = init_state(lambda: Llama(DENSE, nnx.Rngs(0)), OPTIMIZER, plan)
    dense = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan).lower(state, DATA[0]).compile()
    assert all_gathers(compiled, plan) == all_gathers(dense, plan)


# -- composition -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,mesh,options", [
    ("capacity", "data=2,expert=2,tensor=2", ()),
    ("dropless", "data=2,expert=4", (("zero", 3),)),
    ("dropless", "data=2,expert=2,tensor=2", (("zero", 3),)),  # the tiled kernel (auto) on expert + tensor + ZeRO-3
])
def test_moe_composes_with_tensor_parallel_experts_and_zero(mode, mesh, options):
    assert_matches_reference(mode, mesh, **dict(options))


def test_expert_mlp_is_split_over_tensor():
    plan = plan_for("data=2,expert=2,tensor=2")
    cfg = CONFIGS["capacity"]
    specs = plan.param_specs(describe(lambda: MoeLlama(cfg, nnx.Rngs(0))).logical)
    assert specs["blocks"]["moe"]["expert_gate"] == P(None, "expert", None, "tensor")
    assert specs["blocks"]["moe"]["expert_down"] == P(None, "expert", "tensor")
    _, _, _, compiled, plan = run_model("capacity", "data=2,expert=2,tensor=2")
    slots = cfg.top_k * (8 * 16 // 4) * D  # the expert buffers one device holds
    summed = [op for op in inspect.collective_ops(compiled, plan.mesh)
              if op.kind == "all-reduce" and op.axes == ("tensor",) and slots in {math.prod(s) for s in op.shapes}]
    # the experts' row-parallel down projection (forward) and the input gradient (backward), per MoE layer
    assert sum(op.count for op in summed) == 2 * cfg.n_moe_layers


# -- command line ------------------------------------------------------------------------------

MOE_RUN = """[model]
name = "moe-tiny"
d_model = 32
head_dim = 8
n_layers = 1
moe_every = 1
expert_d_ff = 32
[train]
steps = 6
lr = 1e-2
warmup = 1
"""


def test_cli_trains_moe_tiny_with_expert_parallelism_and_shows_routing_metrics(tmp_path):
    config, metrics = tmp_path / "moe.toml", tmp_path / "metrics.jsonl"
    config.write_text(MOE_RUN)
    flags = ["--mesh", "data=2,expert=4", "--batch-size", "8", "--seq-len", "16", "--metrics", str(metrics)]
    assert main(["train", "--config", str(config), *flags]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert {"ce_loss", "load_balance_loss", "dropped_fraction", "expert_share"} <= set(rows[0])
    assert len(rows[0]["expert_share"]) == 8 and sum(rows[0]["expert_share"]) == pytest.approx(1.0)


def test_cli_rejects_experts_that_do_not_split_over_the_expert_axis(tmp_path, capsys):
    config = tmp_path / "moe.toml"
    config.write_text(MOE_RUN.replace("n_layers = 1", "n_layers = 1\nn_experts = 6"))
    assert main(["train", "--config", str(config), "--mesh", "data=2,expert=4"]) == 2
    assert "('experts') of size 6 does not divide by mesh axes expert=4" in " ".join(capsys.readouterr().err.split())


# -- bad input ---------------------------------------------------------------------------------


def test_experts_not_divisible_by_expert_axis_fails_before_compiling():
    cfg = dataclasses.replace(MODEL, n_experts=6)
    with pytest.raises(ValueError, match=r"'experts'.*size 6.*expert=4"):
        init_state(lambda: MoeLlama(cfg, nnx.Rngs(0)), optax.sgd(0.1), plan_for("data=2,expert=4"))
    p = {k: v[:6] if k != "router" else v[:, :6] for k, v in layer_params().items()}
    with plan_for("data=2,expert=4").activate(), pytest.raises(ValueError, match="n_experts=6.*expert=4"):
        experts.moe_ffn(p, jnp.zeros((8, 16, D)), experts.MoEConfig(6))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_moe_under_the_pipeline_matches_one_device_with_its_router_losses(schedule):
    """One MoE block per stage on pipe=2 (with expert and data): losses, gradients and routing metrics as on one
    device. Each stage adds its own layers' router losses per microbatch; bubble slots are NaN so a leak shows."""
    with pipeline.bubble_fill(float("nan")):
        assert_matches_reference("capacity", "data=2,pipe=2,expert=2", schedule=schedule)


def test_dropless_moe_under_the_pipeline_matches_one_device():
    """The tiled dropless layer (moe_kernel auto on CPU) in 1F1B's explicit per-stage VJPs over pipe=2, with expert
    and data; bubble slots are NaN so a leak shows."""
    with pipeline.bubble_fill(float("nan")):
        assert_matches_reference("dropless-every", "data=2,pipe=2,expert=2", schedule="1f1b")


@pytest.mark.parametrize("fields,message", [
    ({"top_k": 9}, "top_k=9 must be between 1 and n_experts=8"),
    ({"capacity_factor": 0.0}, "capacity_factor must be > 0, got 0.0"),
    ({"capacity_factor": -1.0}, "capacity_factor must be > 0"),
    ({"group_size": 5}, "group_size=5 must divide the sequence length 16"),
    ({"moe_every": 3}, "moe_every=3 must be >= 1 and divide n_layers=2"),
])
def test_bad_moe_configs_fail_with_a_clear_message(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MODEL, **fields)

"""Mixed precision: fp32 parameters held once and cast to bf16/fp16 where used, fp16 loss scaling."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import batches, single_device_plan
from jaxpar.train import precision
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.core.plan import Plan
from jaxpar.train.state import abstract_state, describe, init_state, state_specs
from jaxpar.train.step import make_train_step

CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16)
STEPS = 50


def losses(plan: Plan, steps: int = STEPS) -> np.ndarray:
    optimizer = optax.adamw(3e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, plan)
    data = batches(batch_size=16, seq_len=CONFIG.seq_len)
    compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(state, data[0]).compile()
    out = []
    for i in range(steps):
        state, metrics = compiled(state, data[i])
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.fixture(scope="module")
def fp32_losses():
    return losses(single_device_plan())


@pytest.mark.parametrize("zero", [1, 3])
def test_bf16_with_zero_tracks_fp32(fp32_losses, zero):
    """ZeRO-3 casts its fp32 shards at use; ZeRO-1 computes with bf16 params gathered from its fp32 master."""
    bf16 = losses(Plan.create("data=8", zero=zero, precision="bf16"))
    assert np.max(np.abs(bf16 / fp32_losses - 1)) <= 0.05
    assert fp32_losses[-1] < 0.6 * fp32_losses[0]


@pytest.mark.parametrize("mesh, zero", [("data=1", 0), ("data=8", 1)])
def test_fp16_with_loss_scaling_trains_like_fp32(fp32_losses, mesh, zero):
    """A step whose scaled gradients overflow is skipped, so fp16 may trail fp32 by a step; it ends as low."""
    plan = single_device_plan(precision="fp16") if mesh == "data=1" else Plan.create(mesh, zero=zero, precision="fp16")
    fp16 = losses(plan, steps=30)
    assert np.all(np.isfinite(fp16[1:]))
    assert abs(fp16[-10:].mean() / fp32_losses[20:30].mean() - 1) <= 0.05


@pytest.mark.parametrize(
    "name, param_dtype, scaled",
    [("fp32", jnp.float32, False), ("bf16", jnp.float32, False), ("fp16", jnp.float32, True),
     ("bf16-params", jnp.bfloat16, False)],
)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_layout_per_policy(name, param_dtype, scaled, zero):
    """Params held once (fp32 but under bf16-params), the Adam moments like the optimizer state: three
    parameter-shaped arrays per parameter, no 2-byte copy beside an fp32 master.

    But ZeRO-1 under bf16/fp16, whose params are whole on every data rank: there they are held in the 2-byte
    compute dtype, and the fp32 master lives in the optimizer state, sharded over data like the moments.
    """
    optimizer = optax.adamw(1e-3)
    model = describe(lambda: Llama(CONFIG, nnx.Rngs(0)))
    state = abstract_state(model, optimizer, Plan.create("data=8", zero=zero, precision=name))
    master = zero == 1 and name in ("bf16", "fp16")
    held = precision.POLICIES[name].compute_dtype if master else param_dtype
    wq = state.params["blocks"]["wq"]
    sharded, whole = jax.sharding.PartitionSpec(None, "data"), jax.sharding.PartitionSpec()
    assert wq.dtype == held and wq.sharding.spec == (sharded if zero >= 2 else whole)
    opt = state.opt_state
    assert isinstance(opt, precision.MasterState) == master
    assert isinstance(opt, precision.ScaledState) == (scaled and not master)
    if master:
        assert (opt.loss_scale is not None) == scaled
        assert opt.master["blocks"]["wq"].dtype == jnp.float32
        assert opt.master["blocks"]["wq"].sharding.spec == sharded
    adam = opt.inner[0] if scaled or master else opt[0]
    assert adam.mu["blocks"]["wq"].sharding.spec == (sharded if zero >= 1 else whole)
    assert adam.mu["blocks"]["wq"].dtype == param_dtype
    shaped = [a for a in jax.tree.leaves(state) if a.shape == wq.shape]
    assert len(shaped) == 3 + master and [a.dtype for a in shaped].count(jnp.dtype(held)) == 1 + 2 * (not master)


def test_the_model_computes_in_the_compute_dtype_from_fp32_params():
    """bf16: the fp32 params reach the model cast to bf16 (its matmuls are bf16), and the gradients come back in
    bf16, the dtype they are summed over the data ranks in (the optimizer casts them to fp32)."""
    from jaxpar.train.step import loss_and_grads

    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optax.adamw(1e-3), single_device_plan())
    batch = batches(batch_size=8, seq_len=CONFIG.seq_len)[0]
    out = {}
    for name in ("fp32", "bf16"):
        plan = single_device_plan(precision=name)
        with plan.activate():
            loss, _, grads, _ = jax.jit(lambda p, b: loss_and_grads(model, lambda m, x: m(x), p, b, plan))(
                state.params, batch)
            text = jax.jit(lambda p, b: loss_and_grads(model, lambda m, x: m(x), p, b, plan)).lower(
                state.params, batch).as_text()
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32 if name == "fp32" else jnp.bfloat16)}
        out[name] = (float(loss), sum("bf16" in line for line in text.splitlines() if "dot_general" in line))
    assert out["fp32"][1] == 0 and out["bf16"][1] > 0  # matmuls on bf16 weights
    assert out["bf16"][0] != out["fp32"][0] and abs(out["bf16"][0] / out["fp32"][0] - 1) < 0.02


def test_dynamic_loss_scale_skips_overflows_and_grows():
    opt = precision.Optimizer(optax.sgd(0.5), precision.POLICIES["fp16"], initial_scale=8.0, growth_interval=2)
    params32 = {"w": jnp.array([1.0, 2.0])}
    state, params = opt.init(params32), opt.cast(params32)
    apply = jax.jit(opt.apply)

    params, state, metrics = apply({"w": jnp.array([8.0, 8.0], jnp.float16)}, state, params)  # unscaled: 1.0
    assert params["w"].tolist() == [0.5, 1.5] and params["w"].dtype == jnp.float32
    assert float(metrics["loss_scale"]) == 8.0 and int(state.loss_scale.good_steps) == 1

    overflow = {"w": jnp.array([jnp.inf, 1.0], jnp.float16)}
    kept, state, metrics = apply(overflow, state, params)
    assert kept["w"].tolist() == [0.5, 1.5]
    assert not np.isfinite(float(metrics["grad_norm"]))
    assert float(state.loss_scale.scale) == 4.0 and int(state.loss_scale.good_steps) == 0

    for _ in range(2):
        params, state, metrics = apply({"w": jnp.zeros(2, jnp.float16)}, state, params)
    assert float(state.loss_scale.scale) == 8.0 and int(state.loss_scale.good_steps) == 0


def test_unknown_or_mismatched_precision_fails_clearly():
    with pytest.raises(ValueError, match="precision must be one of"):
        Plan.create("data=8", precision="fp8")
    with pytest.raises(ValueError, match="already wrapped for another precision than 'fp32'"):
        precision.wrap(precision.wrap(optax.sgd(0.1), "bf16"), "fp32")


# A vocab-heavy model like test_step_memory's (MaxText's llama2 shape): every dimension divides by data=8.
MEMORY_CONFIG = LlamaConfig(vocab=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=256,
                            seq_len=16)


def test_zero1_bf16_step_holds_2_byte_params_and_gathers_2_bytes():
    """Issue 16: ZeRO-1 under bf16 holds (2 + 2)Psi + 12Psi/N (ZeRO's P_os), not fp32 params whole on every rank.

    The compiled step's arguments are the bf16 params, the fp32 master and Adam's m and v sharded over the 8
    data ranks, the batch and the two step counters; its gathers of the updated params move bf16, each
    parameter once, as their uint16 bits (jaxpar.parallel.bits: XLA's CPU backend widens bf16 collectives to fp32).
    """
    model = describe(lambda: Llama(MEMORY_CONFIG, nnx.Rngs(0)))
    psi, n = model.param_count(), 8
    optimizer = optax.adamw(1e-3)
    plan = Plan.create(f"data={n}", zero=1, precision="bf16")
    state = abstract_state(model, optimizer, plan)
    batch = {k: jax.ShapeDtypeStruct((16, MEMORY_CONFIG.seq_len), jnp.int32, sharding=plan.sharding(plan.batch_spec(1)))
             for k in ("inputs", "targets")}
    lowered = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(state, batch)
    batch_bytes = 2 * (16 // n) * MEMORY_CONFIG.seq_len * 4
    counters = 2 * 4  # the train step and Adam's count (int32)
    arguments = lowered.compile().memory_analysis().argument_size_in_bytes
    assert arguments == 2 * psi + 12 * psi // n + batch_bytes + counters, (arguments, psi)

    gathers = [line.split("->")[-1].strip() for line in lowered.as_text().splitlines() if "all_gather" in line]
    shapes = [re.fullmatch(r"tensor<([\dx]+)x(\w+)>", g.split(" ")[0]).groups() for g in gathers]
    assert {dtype for _, dtype in shapes} == {"ui16"}
    assert sum(math.prod(map(int, dims.split("x"))) for dims, _ in shapes) == psi  # every parameter, once


def test_zero1_bf16_checkpoint_restores_its_fp32_master_onto_zero3_and_back(tmp_path):
    """ZeRO-1's fp32 master is what restores onto ZeRO-3's fp32 params (and another mesh), and ZeRO-3's fp32
    params restore as ZeRO-1's master with the params its bf16 cast; the Adam state restores as saved."""
    from jaxpar.train.checkpoint import Checkpoints

    optimizer = optax.adamw(1e-2)
    data = batches(batch_size=16, seq_len=CONFIG.seq_len)
    first = Plan.create("data=8", zero=1, precision="bf16")
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, first)
    step = make_train_step(model, lambda m, b: m(b), optimizer, first)
    for i in range(2):
        state, _ = step(state, data[i])
    master, adam = jax.device_get(state.opt_state.master), jax.device_get(state.opt_state.inner)
    assert any(not np.array_equal(m, np.asarray(p.astype(jnp.float32)))
               for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(jax.device_get(state.params))))
    same = lambda a, b: all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(a), b)))  # noqa: E731
    with Checkpoints(tmp_path / "zero1") as checkpoints:
        checkpoints.save(2, state, force=True)
    with Checkpoints(tmp_path / "zero1", read_only=True) as checkpoints:
        restored, _ = checkpoints.restore(model, optimizer, Plan.create("data=4,tensor=2", zero=1, precision="bf16"))
        assert same(restored.opt_state.master, master) and same(restored.params, jax.device_get(state.params))
        for target in (Plan.create("data=4,tensor=2", zero=0, precision="bf16"), zero3 := Plan.create(
                "data=8", zero=3, precision="bf16")):
            restored, _ = checkpoints.restore(model, optimizer, target)
            assert same(restored.params, master) and same(restored.opt_state, adam)

    state3, _ = make_train_step(model, lambda m, b: m(b), optimizer, zero3)(restored, data[2])
    params3, adam3 = jax.device_get(state3.params), jax.device_get(state3.opt_state)
    with Checkpoints(tmp_path / "zero3") as checkpoints:
        checkpoints.save(3, state3, force=True)
    for mesh in ("data=8", "data=4,tensor=2"):
        target = Plan.create(mesh, zero=1, precision="bf16")
        with Checkpoints(tmp_path / "zero3", read_only=True) as checkpoints:
            restored, meta = checkpoints.restore(model, optimizer, target)
        assert meta["step"] == 3 and isinstance(restored.opt_state, precision.MasterState)
        assert same(restored.opt_state.master, params3) and same(restored.opt_state.inner, adam3)
        assert same(restored.params, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params3))
        expected = target.shardings(state_specs(model, optimizer, target))
        assert all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), restored,
                                                expected)))
        restored, _ = make_train_step(model, lambda m, b: m(b), optimizer, target)(restored, data[3])  # it trains on



def test_fp16_loss_scale_restores_across_the_zero1_master_layout(tmp_path):
    """fp16's loss scale lives beside the master under ZeRO-1 and beside the inner state elsewhere: it carries over."""
    from jaxpar.train.checkpoint import Checkpoints

    optimizer = optax.adamw(1e-2)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer,
                              Plan.create("data=8", zero=3, precision="fp16"))
    state.opt_state = state.opt_state._replace(loss_scale=precision.LossScale(jnp.float32(64.0), jnp.int32(7)))
    params = jax.device_get(state.params)
    with Checkpoints(tmp_path / "zero3") as checkpoints:
        checkpoints.save(1, state, force=True)
    with Checkpoints(tmp_path / "zero3", read_only=True) as checkpoints:
        zero1, _ = checkpoints.restore(model, optimizer, Plan.create("data=8", zero=1, precision="fp16"))
    assert isinstance(zero1.opt_state, precision.MasterState) and zero1.params["head"].dtype == jnp.float16
    assert float(zero1.opt_state.loss_scale.scale) == 64.0 and int(zero1.opt_state.loss_scale.good_steps) == 7
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(zero1.opt_state.master), params)))
    with Checkpoints(tmp_path / "zero1") as checkpoints:
        checkpoints.save(1, zero1, force=True)
    with Checkpoints(tmp_path / "zero1", read_only=True) as checkpoints:
        back, _ = checkpoints.restore(model, optimizer, Plan.create("data=4,tensor=2", zero=2, precision="fp16"))
    assert isinstance(back.opt_state, precision.ScaledState) and float(back.opt_state.loss_scale.scale) == 64.0
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(back.params), params)))


def test_place_state_converts_between_the_bf16_layouts():
    """A state of fp32 params held once placed onto ZeRO-1 becomes its fp32 master (params the bf16 cast), and back."""
    from jaxpar.train.state import place_state

    optimizer = optax.adamw(1e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan(precision="bf16"))
    fp32 = jax.device_get(state.params)
    zero1 = place_state(jax.device_get(state), model, optimizer, Plan.create("data=8", zero=1, precision="bf16"))
    assert isinstance(zero1.opt_state, precision.MasterState)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(zero1.opt_state.master), fp32)))
    assert {a.dtype for a in jax.tree.leaves(zero1.params)} == {jnp.dtype(jnp.bfloat16)}
    back = place_state(zero1, model, optimizer, Plan.create("data=8", zero=3, precision="bf16"))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(back.params), fp32)))
    assert jax.tree.structure(back.opt_state) == jax.tree.structure(state.opt_state)

"""Mixed precision: fp32 parameters held once and cast to bf16/fp16 where used, fp16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import batches, single_device_plan
from jaxpar import precision
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.plan import Plan
from jaxpar.state import abstract_state, describe, init_state
from jaxpar.step import make_train_step

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


def test_bf16_with_zero3_tracks_fp32(fp32_losses):
    bf16 = losses(Plan.create("data=8", zero=3, precision="bf16"))
    assert np.max(np.abs(bf16 / fp32_losses - 1)) <= 0.05
    assert fp32_losses[-1] < 0.6 * fp32_losses[0]


def test_fp16_with_loss_scaling_trains_like_fp32(fp32_losses):
    """A step whose scaled gradients overflow is skipped, so fp16 may trail fp32 by a step; it ends as low."""
    fp16 = losses(single_device_plan(precision="fp16"), steps=30)
    assert np.all(np.isfinite(fp16[1:]))
    assert abs(fp16[-10:].mean() / fp32_losses[20:30].mean() - 1) <= 0.05


@pytest.mark.parametrize(
    "name, param_dtype, scaled",
    [("fp32", jnp.float32, False), ("bf16", jnp.float32, False), ("fp16", jnp.float32, True),
     ("bf16-params", jnp.bfloat16, False)],
)
def test_state_layout_per_policy(name, param_dtype, scaled):
    """Params held once, replicated under ZeRO-1 (fp32 but under bf16-params); the Adam moments sharded, alike.

    No 2-byte copy beside an fp32 master: the state holds three parameter-shaped arrays per parameter.
    """
    optimizer = optax.adamw(1e-3)
    model = describe(lambda: Llama(CONFIG, nnx.Rngs(0)))
    state = abstract_state(model, optimizer, Plan.create("data=8", zero=1, precision=name))
    wq = state.params["blocks"]["wq"]
    assert wq.dtype == param_dtype and wq.sharding.spec == jax.sharding.PartitionSpec()
    opt = state.opt_state
    assert isinstance(opt, precision.ScaledState) == scaled
    adam = opt.inner[0] if scaled else opt[0]
    assert adam.mu["blocks"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
    assert adam.mu["blocks"]["wq"].dtype == param_dtype
    shaped = [a for a in jax.tree.leaves(state) if a.shape == wq.shape]
    assert len(shaped) == 3 and {a.dtype for a in shaped} == {jnp.dtype(param_dtype)}


def test_the_model_computes_in_the_compute_dtype_from_fp32_params():
    """bf16: the fp32 params reach the model cast to bf16 (its matmuls are bf16), the gradients come back fp32."""
    from jaxpar.step import loss_and_grads

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
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
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

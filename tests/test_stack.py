"""A user's own stacked layers under ZeRO: `jaxpar.Stack` gathers one layer at a time, a model's own scan stays correct.

The reference is plain JAX + optax on one device: a Python loop over the
layers of the unsharded parameter dict, nothing from jaxpar in its forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import ResidualMLP, max_relative_error
from jaxpar.planner import inspect
LAYERS, WIDTH, HIDDEN, BATCH, STEPS = 4, 32, 64, 16, 3
INIT = nnx.initializers.lecun_normal()


class StackModel(nnx.Module):
    """The blocks on jaxpar's stacked-layer block."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = jaxpar.Stack(ResidualMLP, LAYERS, rngs=rngs)

    def __call__(self, x):
        return self.blocks(x)


class OwnScanModel(nnx.Module):
    """Parameters stacked on a logical `layers` axis, run by the model's own `lax.scan` (no jaxpar)."""

    def __init__(self, rngs: nnx.Rngs):
        keys = jax.random.split(rngs.params(), 2)
        self.up = nnx.Param(INIT(keys[0], (LAYERS, WIDTH, HIDDEN)), out_sharding=("layers", "embed", "mlp"))
        self.down = nnx.Param(INIT(keys[1], (LAYERS, HIDDEN, WIDTH)), out_sharding=("layers", "mlp", "embed"))

    def __call__(self, x):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None

        return jax.lax.scan(layer, x, (self.up[...], self.down[...]))[0]


def kernels(params):
    """The (up, down) stacked weights of either model's parameter dict."""
    if "blocks" in params:
        layers = params["blocks"]["layers"]
        return layers["up"]["kernel"], layers["down"]["kernel"]
    return params["up"], params["down"]


def reference(params, batches, optimizer):
    """Plain JAX + optax on one device: losses per step and final parameters."""
    def loss(p, batch):
        up, down = kernels(p)
        h = batch["x"]
        for i in range(LAYERS):
            h = h + jax.nn.gelu(h @ up[i]) @ down[i]
        return jnp.mean((h - batch["y"]) ** 2)

    state, losses = optimizer.init(params), []
    for batch in batches:
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return np.array(losses), params


def data():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for _ in range(STEPS)]
    return [{"x": x, "y": np.tanh(x)} for x in xs]


def run(make_model, mesh: str, **options):
    """jaxpar on `mesh`: (losses, final parameters on host, compiled step, plan)."""
    optimizer = optax.sgd(0.1)
    plan = jaxpar.Plan.create(mesh, **options)
    model, state = jaxpar.init_state(make_model, optimizer, plan)
    step = jaxpar.make_train_step(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), optimizer, plan)
    batches = data()
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params), compiled, plan


@pytest.mark.parametrize("make_model", [StackModel, OwnScanModel], ids=["stack", "own-scan"])
@pytest.mark.parametrize("zero, remat", [(0, "full"), (2, "none"), (3, "none")])
@pytest.mark.filterwarnings("ignore::jaxpar.core.usage.PlanOptionUnused")  # remat does not wrap the model's own scan
def test_stacked_layers_under_zero_match_one_device(make_model, zero, remat):
    """Every layer computes with whole parameters whether jaxpar or the model's own scan walks the stack. ZeRO-0
    under remat sums each layer's gradients where the layer uses them: per layer in jaxpar's scan, the whole stack
    at once in the model's own."""
    losses, params, _, _ = run(lambda: make_model(nnx.Rngs(0)), "data=8", zero=zero, remat=remat)
    with nnx.use_eager_sharding(False):
        start = nnx.to_pure_dict(nnx.state(make_model(nnx.Rngs(0)), nnx.Param))
    ref_losses, ref_params = reference(start, data(), optax.sgd(0.1))
    assert np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)) <= 1e-5
    assert max_relative_error(kernels(params), kernels(ref_params)) <= 1e-5


def test_stack_gathers_one_layer_at_a_time():
    """ZeRO-3 on the Stack: each kernel is all-gathered inside the layer scan, once forward and once backward."""
    _, _, compiled, plan = run(lambda: StackModel(nnx.Rngs(0)), "data=8", zero=3)
    gathers = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "all-gather"]
    per_layer = [op for op in gathers if op.count == LAYERS]
    assert sum(op.count for op in per_layer) == 2 * 2 * LAYERS  # 2 kernels, forward + backward
    assert all(op.count == LAYERS for op in gathers)  # no whole-stack gather left outside the scan


class NormBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return x + self.norm(self.lin(x))


def test_stack_writes_back_each_layers_batch_statistics():
    """Variables other than parameters come out of the scan per layer, as a loop over the blocks leaves them."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
    stack = jaxpar.Stack(NormBlock, 3, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(jaxpar.Stack(NormBlock, 3, rngs=nnx.Rngs(0)).layers, nnx.Param, ...)
    h, means = x, []
    for i in range(3):
        pick = lambda tree: jax.tree.map(lambda a: a[i], nnx.to_pure_dict(tree))  # noqa: E731
        block = nnx.merge(graphdef, pick(params), pick(rest))
        h = block(h)
        means.append(block.norm.mean[...])
    y = stack(x)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stack.layers.norm.mean[...], jnp.stack(means), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(stack.layers.norm.mean[...]).max()) > 0


def test_an_interleaved_pipeline_in_a_users_own_loop_is_told_the_layer_order():
    """Outside jaxpar's train step an interleaved plan cannot know the order of the stacked layers it is given:
    it refuses them unless `layer_order` names it, and both orders then give the one-device loss."""
    from test_user_pipeline import TinyLM, data
    from test_user_pipeline import reference as one_device

    plan = jaxpar.Plan.create("data=4,pipe=2", schedule="interleaved", virtual_stages=2)
    model, state = jaxpar.init_state(lambda: TinyLM(nnx.Rngs(0)), optax.sgd(0.0), plan)
    held = jax.device_get(state.params)  # a train state on the plan: pipeline order
    # stored row (i v + k) c + r holds natural layer (k p + i) c + r: p = v = 2, c = 1, a swap of rows 1 and 2
    natural = {**held, "blocks": jax.tree.map(lambda x: x[np.array([0, 2, 1, 3])], held["blocks"])}
    batch = data()[0]
    expected = one_device(natural, optax.sgd(0.0))[0][0]

    def loss(params, order):
        module = model.merge(params)
        return jaxpar.pipelined_loss(module, module.blocks, lambda m, tokens: m.embed(tokens),
                                     lambda m, x, targets: m.loss(x, targets), batch["inputs"], batch["targets"],
                                     layer_order=order)

    with plan.activate():
        with pytest.raises(ValueError, match=r"pipe=2 x virtual_stages=2.*layer_order='natural'"):
            loss(natural, None)
        with pytest.raises(ValueError, match="layer_order must be one of"):
            loss(natural, "reversed")
        given = {order: float(jax.jit(loss, static_argnums=1)(params, order))
                 for order, params in (("natural", natural), ("pipeline", held))}
        permuted = float(jax.jit(loss, static_argnums=1)(natural, "pipeline"))
    for order, value in given.items():
        assert abs(value / expected - 1) <= 1e-5, (order, value, expected)
    assert abs(permuted / expected - 1) > 1e-3, "the test cannot tell a permuted stack from the right one"

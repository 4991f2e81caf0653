"""A user's own Flax language model on `jaxpar.Stack` runs every pipeline schedule and matches one device.

The reference is plain JAX + optax on one device (a loop over the stacked
layers); pipeline bubbles are filled with NaN so that a leak shows.
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
from jaxpar.pipeline import executor as pipeline
VOCAB, WIDTH, HIDDEN, LAYERS, BATCH, SEQ, STEPS = 64, 32, 64, 4, 16, 8, 2
INIT = nnx.initializers.lecun_normal()


class TinyLM(nnx.Module):
    """Embedding, a stack of blocks, an output layer: the shape of a user's GPT."""

    def __init__(self, rngs: nnx.Rngs):
        table = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed = nnx.Embed(VOCAB, WIDTH, embedding_init=table, rngs=rngs)
        self.blocks = jaxpar.Stack(ResidualMLP, LAYERS, rngs=rngs)
        self.out = nnx.Linear(WIDTH, VOCAB, use_bias=False, kernel_init=nnx.with_partitioning(INIT, ("embed", "vocab")),
                              rngs=rngs)

    def loss(self, x, targets):
        return optax.softmax_cross_entropy_with_integer_labels(self.out(x), targets).mean()

    def __call__(self, batch):
        return jaxpar.pipelined_loss(self, self.blocks, lambda m, tokens: m.embed(tokens),
                                     lambda m, x, targets: m.loss(x, targets), batch["inputs"], batch["targets"])


def data():
    rng = np.random.default_rng(0)
    draw = lambda: rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)  # noqa: E731
    return [{"inputs": draw(), "targets": draw()} for _ in range(STEPS)]


def reference(params, optimizer):
    def loss(p, batch):
        layers = p["blocks"]["layers"]
        h = p["embed"]["embedding"][batch["inputs"]]
        for i in range(LAYERS):
            h = h + jax.nn.gelu(h @ layers["up"]["kernel"][i]) @ layers["down"]["kernel"][i]
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"]["kernel"], batch["targets"]).mean()

    state, losses = optimizer.init(params), []
    for batch in data():
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        params, _ = optax.apply_updates(params, updates), losses.append(float(value))
    return np.array(losses), params


@pytest.mark.parametrize("mesh, options", [
    ("data=4,pipe=2", {"schedule": "gpipe"}),
    ("data=4,pipe=2", {"schedule": "1f1b", "microbatches": 4}),
    ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2}),
    ("data=4,pipe=2", {"schedule": "zb-h1", "microbatches": 4}),
    ("data=2,tensor=2,pipe=2", {"schedule": "1f1b", "zero": 3}),
    ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4, "zero": 3}),
], ids=["gpipe", "1f1b", "interleaved", "zb-h1", "1f1b-tensor-zero3", "interleaved-zero3"])
def test_user_model_pipelines_like_one_device(mesh, options):
    optimizer = optax.sgd(0.5)
    plan = jaxpar.Plan.create(mesh, **options)
    model, state = jaxpar.init_state(lambda: TinyLM(nnx.Rngs(0)), optimizer, plan)
    step = jaxpar.make_train_step(model, lambda m, b: m(b), optimizer, plan)
    with pipeline.bubble_fill(float("nan")):
        compiled = step.lower(state, data()[0]).compile()
    losses = []
    for batch in data():
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))

    with nnx.use_eager_sharding(False):
        start = nnx.to_pure_dict(nnx.state(TinyLM(nnx.Rngs(0)), nnx.Param))
    ref_losses, ref_params = reference(start, optimizer)
    assert np.max(np.abs(np.array(losses) - ref_losses) / ref_losses) <= 1e-5
    params = jaxpar.to_natural_order(jax.device_get(state.params), model.logical, plan)  # as the state holds them
    assert max_relative_error(params, ref_params) <= 1e-5
    permutes = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "collective-permute"]
    assert permutes and all(op.axes == ("pipe",) for op in permutes)
    layers = state.params["blocks"]["layers"]["up"]["kernel"]
    assert layers.sharding.spec[0] == "pipe"  # each stage holds only its own layers


def test_pipe_without_a_pipeline_is_refused():
    class Plain(TinyLM):
        def __call__(self, batch):
            return self.loss(self.blocks(self.embed(batch["inputs"])), batch["targets"])

    optimizer = optax.sgd(0.5)
    plan = jaxpar.Plan.create("data=4,pipe=2")
    model, state = jaxpar.init_state(lambda: Plain(nnx.Rngs(0)), optimizer, plan)
    step = jaxpar.make_train_step(model, lambda m, b: m(b), optimizer, plan)
    with pytest.raises(ValueError, match="pipe=2 but the model ran no pipeline"):
        step.lower(state, data()[0])

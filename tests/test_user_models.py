"""A user's model with non-parameter state (BatchNorm, dropout) trains like a plain optax loop; unused plan options are refused or warned about."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.core.usage import PlanOptionUnused

STEPS = 3
INIT = nnx.initializers.lecun_normal()


class Net(nnx.Module):
    """Linear -> BatchNorm -> relu -> Dropout -> Linear, with a counter: every kind of non-parameter state.

    No bias before the BatchNorm: the loss would not depend on it, and Adam
    would turn its round-off gradient into full steps that move the statistics.
    """

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, use_bias=False, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")),
                             rngs=rngs)
        self.norm = nnx.BatchNorm(32, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.down = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(INIT, ("mlp", None)), rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.down(self.drop(jax.nn.relu(self.norm(self.up(x)))))


def make():
    return Net(nnx.Rngs(0, dropout=1))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


DATA = [
    {"x": x, "y": np.tanh(x[:, :4])}
    for x in np.random.default_rng(0).normal(size=(STEPS, 16, 8)).astype(np.float32)
]


def reference():
    """Plain single-device nnx + optax: each dropout stream keyed fold_in(its seed key, step), as documented."""
    with nnx.use_eager_sharding(False):
        model = make()
    graphdef, *states = nnx.split(model, nnx.Param, nnx.RngState, ...)
    params, seeds, others = map(nnx.to_pure_dict, states)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    losses = []
    for t, batch in enumerate(DATA):
        rngs = jax.tree.map(lambda v: jax.random.fold_in(v, t) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
                            else jnp.zeros_like(v), seeds)

        def loss(p):
            m = nnx.merge(graphdef, p, rngs, others)
            value = loss_fn(m, batch)
            return value, nnx.to_pure_dict(nnx.split(m, nnx.Param, nnx.RngState, ...)[3])

        (value, others), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return np.array(losses), others


def train(plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanOptionUnused)
        model, state = jaxpar.init_state(make, optax.adam(1e-2), plan)
        step = jaxpar.make_train_step(model, loss_fn, optax.adam(1e-2), plan)
        losses = []
        for batch in DATA:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.variables)


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize("mesh, options", [("data=8", {}), ("data=8", {"zero": 3}), ("data=4,tensor=2", {})])
def test_batchnorm_and_dropout_match_a_plain_optax_loop(expected, mesh, options):
    """Losses within 1e-5; BatchNorm statistics (over the global batch) and the counter equal the reference's."""
    ref_losses, ref_variables = expected
    losses, variables = train(jaxpar.Plan.create(mesh, **options))
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert int(variables["calls"]) == STEPS
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), variables, ref_variables)


def test_a_checkpoint_keeps_the_variables_and_resumes_exactly_on_another_mesh(expected, tmp_path):
    """Two steps on data=8, saved; restored onto data=4,tensor=2 for the third: the reference's losses and statistics."""
    from jaxpar.train.checkpoint import Checkpoints

    ref_losses, ref_variables = expected
    optimizer = optax.adam(1e-2)
    first = jaxpar.Plan.create("data=8")
    model, state = jaxpar.init_state(make, optimizer, first)
    step = jaxpar.make_train_step(model, loss_fn, optimizer, first)
    losses = []
    for batch in DATA[:2]:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    with Checkpoints(tmp_path, async_save=False) as saved:
        saved.save(2, state)
    second = jaxpar.Plan.create("data=4,tensor=2")
    with Checkpoints(tmp_path, read_only=True) as saved:
        state, _ = saved.restore(model, optimizer, second)
    assert int(state.variables["calls"]) == 2
    state, metrics = jaxpar.make_train_step(model, loss_fn, optimizer, second)(state, DATA[2])
    losses.append(float(metrics["loss"]))
    assert np.max(np.abs(np.array(losses) / ref_losses - 1)) <= 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), jax.device_get(state.variables),
                 ref_variables)


def test_dropout_draws_the_same_on_any_mesh_and_changes_with_the_step():
    """The per-step keys depend on (seed, step) only: two steps differ, two meshes agree."""
    def outputs(plan):
        model, state = jaxpar.init_state(make, optax.sgd(0.0), plan)
        step = jaxpar.make_train_step(model, lambda m, b: (loss_fn(m, b), {"y0": m(b["x"])[0, 0]}), optax.sgd(0.0),
                                      plan)
        firsts = []
        for _ in range(2):
            state, metrics = step(state, DATA[0])
            firsts.append(float(metrics["loss"]))
        return firsts

    one, eight = outputs(jaxpar.Plan.create("data=1", devices=jax.devices()[:1])), outputs(jaxpar.Plan.create("data=8"))
    assert one[0] != one[1]
    np.testing.assert_allclose(eight, one, rtol=1e-6)


def test_loss_fn_taking_rngs_gets_a_per_step_key():
    plan = jaxpar.Plan.create("data=8")
    model, state = jaxpar.init_state(make, optax.sgd(0.0), plan)

    def noisy(m, b, rngs):
        return loss_fn(m, b), {"noise": jax.random.normal(rngs(), ())}

    step = jaxpar.make_train_step(model, noisy, optax.sgd(0.0), plan, seed=5)
    state, first = step(state, DATA[0])
    _, second = step(state, DATA[0])
    expected = jax.random.normal(nnx.Rngs(jax.random.fold_in(jax.random.key(5), 0))(), ())
    assert float(first["noise"]) == pytest.approx(float(expected))
    assert float(first["noise"]) != float(second["noise"])


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def lower(mesh, **options):
    plan = jaxpar.Plan.create(mesh, **options)
    model, state = jaxpar.init_state(lambda: MLP(nnx.Rngs(0)), optax.sgd(0.1), plan)
    return jaxpar.make_train_step(model, loss_fn, optax.sgd(0.1), plan).lower(state, DATA[0])


@pytest.mark.parametrize("mesh, options, message", [
    ("data=4,pipe=2", {}, "pipe=2 but the model ran no pipeline: every pipe rank would repeat the whole model"),
    ("data=4,tensor=2", {"tensor_form": "explicit"}, "tensor_form='explicit' runs the model once per tensor rank"),
])
def test_options_that_would_be_wrong_or_wasteful_are_refused(mesh, options, message):
    with pytest.raises(ValueError, match=message):
        lower(mesh, **options)


@pytest.mark.parametrize("mesh, options, message", [
    ("data=4,tensor=2", {"sequence_parallel": True}, "sequence_parallel=True has no effect: the model ran no "
                                                     "tensor-parallel layer"),
    ("data=8", {"tensor_form": "explicit"}, "tensor_form='explicit' has no effect"),
    ("data=4,expert=2", {}, "expert=2 acts as more data parallelism: the model ran no MoE layer"),
    ("tensor=8", {"zero": 1}, "zero=1 has no effect: the data axis has size 1"),
    ("data=8", {"remat": "full"}, "remat='full' has no effect: the model ran no stacked-layer block"),
])
def test_options_that_do_nothing_warn(mesh, options, message):
    with pytest.warns(PlanOptionUnused, match=message.replace("(", r"\(")):
        lower(mesh, **options)


def test_a_tensor_axis_that_splits_no_parameter_warns():
    """An unannotated model on tensor=2: every tensor rank would repeat the work, and the step says so."""
    class Unnamed(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up, self.down = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    plan = jaxpar.Plan.create("data=4,tensor=2")
    model, state = jaxpar.init_state(lambda: Unnamed(nnx.Rngs(0)), optax.sgd(0.1), plan)
    with pytest.warns(PlanOptionUnused, match="tensor=2 splits nothing: no parameter has a logical name"):
        jaxpar.make_train_step(model, loss_fn, optax.sgd(0.1), plan).lower(state, DATA[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOptionUnused)
        lower("data=4,tensor=2")  # the annotated MLP splits its width over tensor


def test_options_that_act_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanOptionUnused)
        lower("data=8", zero=1)


def test_accumulated_microbatches_pass_the_variables_on():
    """Under grad_accum the model's variables go from one microbatch to the next, as over consecutive batches."""
    plan = jaxpar.Plan.create("data=8", grad_accum=2)
    model, state = jaxpar.init_state(make, optax.adam(1e-2), plan)
    step = jaxpar.make_train_step(model, loss_fn, optax.adam(1e-2), plan)
    state, metrics = step(state, {k: np.concatenate([v, v]) for k, v in DATA[0].items()})
    assert int(state.variables["calls"]) == 2 and np.isfinite(float(metrics["loss"]))


class DropoutBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")), rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.linear(x))


def test_dropout_in_stacked_layers_is_keyed_per_layer_and_step():
    """A Stack's layers hold one key each: folded with the step, the same on one device and on data=8."""
    make_stack = lambda: jaxpar.Stack(DropoutBlock, 2, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731

    def losses(plan):
        model, state = jaxpar.init_state(make_stack, optax.sgd(0.0), plan)
        step = jaxpar.make_train_step(model, lambda m, b: jnp.mean(m(b["x"]) ** 2), optax.sgd(0.0), plan)
        out = []
        for _ in range(2):
            state, metrics = step(state, DATA[0])
            out.append(float(metrics["loss"]))
        return out

    one = losses(jaxpar.Plan.create("data=1", devices=jax.devices()[:1]))
    assert one[0] != one[1]
    np.testing.assert_allclose(losses(jaxpar.Plan.create("data=8")), one, rtol=1e-6)

"""Flax's own conventions work: rule pairs, a user's mesh-axis names, nnx.logical_axis_rules, nnx.Optimizer, a bare scalar loss; jaxpar's checks speak first."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxpar

INIT = nnx.initializers.lecun_normal()
RULES = (("batch", "data"), ("embed", None), ("hidden", "model"))
JAXPAR_RULES = (("embed", None), ("hidden", "tensor"))


class DotReluDot(nnx.Module):
    """The model of Flax's guide "Scale up Flax modules on multiple devices", annotated with the mesh axis `model`."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.dot1 = nnx.Linear(depth, depth, kernel_init=nnx.with_partitioning(INIT, (None, "model")), use_bias=False,
                               rngs=rngs)
        self.w2 = nnx.Param(INIT(rngs.params(), (depth, depth)), out_sharding=("model", None))

    def __call__(self, x):
        return jax.nn.relu(self.dot1(x)) @ self.w2[...]


class Logical(nnx.Module):
    """The same model with logical names, for rule pairs."""

    def __init__(self, rngs: nnx.Rngs):
        self.dot1 = nnx.Linear(16, 16, kernel_init=nnx.with_partitioning(INIT, ("embed", "hidden")), use_bias=False,
                               rngs=rngs)
        self.w2 = nnx.Param(INIT(rngs.params(), (16, 16)), out_sharding=("hidden", "embed"))

    def __call__(self, x):
        return jax.nn.relu(self.dot1(x)) @ self.w2[...]


def loss_fn(model, batch):  # a bare scalar, as the Flax guide writes it
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


BATCHES = [{"x": x, "y": np.sin(x)} for x in np.random.default_rng(0).normal(size=(3, 16, 16)).astype(np.float32)]


def reference(make) -> np.ndarray:
    """Plain single-device nnx + optax."""
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(make())
    params = nnx.to_pure_dict(params)
    tx = optax.adam(1e-2)
    opt_state, losses = tx.init(params), []
    for batch in BATCHES:
        value, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return np.array(losses)


def train(make, plan, optimizer):
    model, state = jaxpar.init_state(make, optimizer, plan)
    step = jaxpar.make_train_step(model, loss_fn, optimizer, plan)
    losses = []
    for batch in BATCHES:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def user_mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_guide_model_on_the_users_mesh_with_an_nnx_optimizer():
    """model -> tensor: the guide's parameters shard over tensor and train like one device; nnx.Optimizer accepted."""
    make = lambda: DotReluDot(16, nnx.Rngs(0))  # noqa: E731
    with nnx.use_eager_sharding(False):
        optimizer = nnx.Optimizer(make(), optax.adam(1e-2), wrt=nnx.Param)
    plan = jaxpar.Plan.create(user_mesh(), axis_names={"model": "tensor"})
    losses, state = train(make, plan, optimizer)
    assert state.params["dot1"]["kernel"].sharding.spec == P(None, "tensor")
    assert state.params["w2"].sharding.spec == P("tensor")
    assert np.max(np.abs(losses / reference(make) - 1)) <= 1e-5


def test_rule_pairs_inside_nnx_logical_axis_rules():
    """Flax-style (logical, mesh) pairs, naming the user's axis; init_state called inside nnx.logical_axis_rules."""
    make = lambda: Logical(nnx.Rngs(0))  # noqa: E731
    plan = jaxpar.Plan.create(user_mesh(), axis_names={"model": "tensor"}, rules=RULES)
    with nnx.logical_axis_rules(RULES):
        losses, state = train(make, plan, optax.adam(1e-2))
    assert state.params["dot1"]["kernel"].sharding.spec == P(None, "tensor")
    assert np.max(np.abs(losses / reference(make) - 1)) <= 1e-5


@pytest.mark.parametrize("rules, message", [
    ((("hidden", "tensor"), ("hidden", None)), "logical axis 'hidden' has two rules"),
    ((("hidden",),), "a rule is a \\(logical name, mesh axes\\) pair"),
    (RULES, "rule 'hidden' -> 'model' names mesh axis 'model', not one of jaxpar's"),
])
def test_bad_rule_pairs(rules, message):
    with pytest.raises(ValueError, match=message):
        jaxpar.Plan.create("data=8", rules=rules)


def test_unknown_mesh_axis_names_the_mapping():
    with pytest.raises(ValueError, match=r"mesh axes \['model'\] are not jaxpar's .* axis_names=\{'model': 'tensor'\}"):
        jaxpar.Plan.create(user_mesh())


def test_optimizer_over_other_variables_refused():
    with nnx.use_eager_sharding(False):
        optimizer = nnx.Optimizer(Logical(nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Variable)
    with pytest.raises(ValueError, match="jaxpar optimizes the model's nnx.Param variables"):
        jaxpar.init_state(lambda: Logical(nnx.Rngs(0)), optimizer, jaxpar.Plan.create("data=8", rules=JAXPAR_RULES))


@pytest.fixture(scope="module")
def plain_step():
    plan = jaxpar.Plan.create("data=8", rules=JAXPAR_RULES)
    model, state = jaxpar.init_state(lambda: Logical(nnx.Rngs(0)), optax.sgd(0.1), plan)
    return model, state, plan


def test_indivisible_batch_is_jaxpars_message(plain_step):
    model, state, plan = plain_step
    step = jaxpar.make_train_step(model, loss_fn, optax.sgd(0.1), plan)
    batch = {k: v[:12] for k, v in BATCHES[0].items()}
    with pytest.raises(ValueError, match=r"global batch 12 does not divide by the batch axes data=8"):
        step(state, batch)


def test_constraint_over_a_manual_axis_is_jaxpars_message(plain_step):
    model, state, plan = plain_step

    def constrained(m, batch):
        return jnp.mean(jax.lax.with_sharding_constraint(m(batch["x"]), P("data", None)) ** 2)

    step = jaxpar.make_train_step(model, constrained, optax.sgd(0.1), plan)
    with pytest.raises(ValueError, match="a sharding constraint in the model names mesh axis 'data', but the step "
                                         "runs the model once per data rank"):
        step.lower(state, BATCHES[0])


def test_loss_with_aux_and_bad_returns(plain_step):
    model, state, plan = plain_step
    with_aux = jaxpar.make_train_step(model, lambda m, b: (loss_fn(m, b), {"two": 2.0}), optax.sgd(0.1), plan)
    assert float(with_aux(state, BATCHES[0])[1]["two"]) == 2.0
    _, state = jaxpar.init_state(lambda: Logical(nnx.Rngs(0)), optax.sgd(0.1), plan)
    per_row = jaxpar.make_train_step(model, lambda m, b: jnp.mean(m(b["x"]), axis=1), optax.sgd(0.1), plan)
    with pytest.raises(ValueError, match="loss_fn must return a scalar loss"):
        per_row.lower(state, BATCHES[0])

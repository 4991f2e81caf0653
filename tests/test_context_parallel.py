"""Context parallelism: the sequence split over `context` trains like one device, and K/V move as the formula says."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import ResidualMLP, max_relative_error
from jaxpar.parallel import attention
from jaxpar.planner import inspect
from jaxpar.core import rules
from jaxpar.parallel import tensor
from jaxpar.core.plan import Plan
from jaxpar.train.state import abstract_state, describe
from jaxpar.train.step import make_train_step
from jaxpar.core.usage import PlanOptionUnused
from test_tensor_parallel import BATCH, CONFIG, OPTIMIZER, make_plan, reference, run, token_batches

# Both forms, context 2 and 4, alone and with data, tensor (both layer forms, sequence parallelism) and ZeRO-3;
# the default run covers each of those at least once, `-m slow` adds the rest of the grid.
slow = pytest.mark.slow
CASES = [
    ("context=2", "all-gather", {}),
    ("context=4", "ring", {}),
    ("data=2,context=4", "all-gather", {"zero": 3}),
    ("context=4,tensor=2", "ring", {"sequence_parallel": True}),
    ("context=2,tensor=2", "all-gather", {"tensor_form": "explicit"}),
    ("data=2,context=2,tensor=2", "ring", {"tensor_form": "explicit", "sequence_parallel": True, "zero": 3}),
    pytest.param("context=2", "ring", {}, marks=slow),
    pytest.param("context=4", "all-gather", {}, marks=slow),
    pytest.param("data=4,context=2", "ring", {}, marks=slow),
    pytest.param("data=2,context=4", "ring", {"zero": 3}, marks=slow),
]
IDS = [f"{mesh}-{form}" + "".join(f"-{k}={v}" for k, v in options.items())
       for mesh, form, options in (c.values if hasattr(c, "values") else c for c in CASES)]


@functools.cache
def context_run(mesh: str, form: str, options: tuple):
    plan = make_plan(mesh, context_form=form, **dict(options))
    model, state, _ = reference()
    return plan, *run(model, state, plan)


@pytest.mark.parametrize("mesh, form, options", CASES, ids=IDS)
def test_training_matches_single_device(mesh, form, options):
    ref_losses, ref_grads = reference()[2]
    _, _, losses, grads = context_run(mesh, form, tuple(options.items()))
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    for got, want in zip(grads, ref_grads):
        assert max_relative_error(got, want) <= 1e-5
    assert ref_losses[-1] < ref_losses[0]


def kv_block_bytes(plan) -> int:
    """K and V of one device's share of the sequence: [batch, seq / context, kv_heads, head_dim] each, fp32."""
    b, s = BATCH // plan.shape["data"], CONFIG.seq_len // plan.shape["context"]
    return 2 * b * s * CONFIG.n_kv_heads * CONFIG.head_dim * 4


@pytest.mark.parametrize("mesh, form", [("context=2", "all-gather"), ("context=4", "ring"),
                                        pytest.param("context=2", "ring", marks=slow),
                                        pytest.param("context=4", "all-gather", marks=slow)])
def test_kv_traffic_per_layer_is_three_times_context_minus_one_blocks(mesh, form):
    """(C − 1) K/V blocks per device forward, again in the backward's recomputed forward, and their gradients.

    All-gather form: all-gathers of K and V (forward twice), reduce-scatters of
    dK and dV. Ring form: C − 1 collective-permutes of K and of V per pass,
    and of dK and dV backward. Nothing else over `context` inside the layers
    moves activations: the rest is the weights' gradients, all-reduced.
    """
    plan, compiled, _, _ = context_run(mesh, form, ())
    c = plan.shape["context"]
    ops = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.axes == ("context",)]
    layers = [op for op in ops if op.count == CONFIG.n_layers and op.kind != "all-reduce"]
    kinds = sorted(op.kind for op in layers)
    if form == "all-gather":
        assert kinds == ["all-gather"] * 4 + ["reduce-scatter"] * 2
    else:
        assert kinds == ["collective-permute"] * 6 * (c - 1)
    assert sum(op.traffic for op in layers) == pytest.approx(3 * (c - 1) * kv_block_bytes(plan))
    assert not [op for op in ops if op.kind != "all-reduce" and op not in layers]


def test_every_device_holds_two_mirrored_chunks():
    order = attention.balanced_order(16, 4)
    assert order.reshape(4, 2, 2).tolist() == [[[0, 1], [14, 15]], [[2, 3], [12, 13]], [[4, 5], [10, 11]],
                                                [[6, 7], [8, 9]]]
    pairs = [int(sum(p + 1 for p in rank)) for rank in order.reshape(4, 4)]  # (query, key) pairs under the mask
    assert pairs == [34] * 4


# (form, mesh, sinks): each form plain, and with sinks while tensor splits the heads (and the sinks with them)
LAYER_CELLS = [(form, mesh, sinks) for sinks, mesh in ((False, "data=2,context=4"), (True, "context=4,tensor=2"))
               for form in attention.FORMS]


@pytest.mark.parametrize("form, mesh, sinks", LAYER_CELLS, ids=[f"{f}-{m}{'-sinks' * s}" for f, m, s in LAYER_CELLS])
def test_attention_layer_matches_plain_attention_forward_and_backward(form, mesh, sinks):
    """The public block on its own under context parallelism (heads split over tensor too), with and without
    gpt-oss's sink logits, against the unsharded computation in natural order: value and the gradients of q, k, v
    (and the sinks, summed over every context rank's queries)."""
    keys = iter(jax.random.split(jax.random.key(3), 5))
    q = jax.random.normal(next(keys), (4, 32, 4, 8))
    k, v = (jax.random.normal(next(keys), (4, 32, 2, 8)) for _ in range(2))
    logits = jax.random.normal(next(keys), (4,)) if sinks else None
    argnums = (0, 1, 2, 4) if sinks else (0, 1, 2)

    def loss(q, k, v, weights, logits):
        return jnp.sum(attention.causal_attention(q, k, v, sinks=logits) * weights)

    weights = jax.random.normal(next(keys), q.shape)
    want = jax.jit(jax.value_and_grad(loss, argnums=argnums))(q, k, v, weights, logits)
    plan = Plan.create(mesh, context_form=form)
    with plan.activate():
        order = np.asarray(attention.positions(32))
        shuffled = [x[:, order] for x in (q, k, v, weights)]
        value, grads = jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=argnums))(*shuffled, logits))
    assert value == pytest.approx(float(want[0]), rel=1e-5)
    inverse = np.argsort(order)
    assert max_relative_error(tuple(g[:, inverse] for g in grads[:3]), want[1][:3]) <= 1e-5
    if sinks:
        assert max_relative_error(grads[3], want[1][3]) <= 1e-5
        assert float(jnp.abs(want[1][3]).max()) > 1e-3  # the sinks take part


def test_sequence_that_does_not_divide_by_twice_context_fails_before_compiling():
    plan = make_plan("context=4")
    model = describe(lambda: reference_model(seq_len=12))
    step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
    with pytest.raises(ValueError, match=r"sequence length 12 does not divide by 2 x context=4 = 8"):
        step.lower(abstract_state(model, OPTIMIZER, plan), token_batches(model_config(seq_len=12))[0])


def test_plan_refuses_unknown_form():
    with pytest.raises(ValueError, match="context_form must be one of"):
        Plan.create("context=2", devices=jax.devices()[:2], context_form="ulysses")


@pytest.mark.parametrize("mesh", ["data=2,context=2,tensor=2", "pipe=2,context=2,tensor=2"])
def test_context_and_annotation_tensor_in_a_shard_map_are_refused_where_xla_aborts_on_them(mesh):
    """jax >= 0.12: XLA's partitioner aborts the process on these layouts; it must be a ValueError instead."""
    def make(form):
        return Plan.create(mesh, tensor_form=form)

    make("explicit")
    if jax.__version_info__ >= (0, 12):
        with pytest.raises(ValueError, match="tensor_form='explicit'"):
            make("annotation")
    else:
        assert make("annotation").tensor_form == "annotation"


def test_ring_form_without_a_context_axis_is_warned_about():
    plan = make_plan("data=2", context_form="ring")
    model = describe(lambda: reference_model())
    step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
    with pytest.warns(PlanOptionUnused, match="context_form='ring' has no effect"):
        step.lower(abstract_state(model, OPTIMIZER, plan), token_batches()[0])


class OwnEmbedding(nnx.Module):
    """A user's model that looks its tokens up itself but uses jaxpar's attention and loss."""

    def __init__(self, rngs: nnx.Rngs, vocab=64, d=16, heads=2, head_dim=8):
        init = nnx.initializers.normal(0.1)
        self.table = nnx.Param(init(rngs.params(), (vocab, d)))
        self.wqkv = nnx.Param(init(rngs.params(), (3, d, heads, head_dim)))
        self.wo = nnx.Param(init(rngs.params(), (heads, head_dim, d)))
        self.head = nnx.Param(init(rngs.params(), (d, vocab)))

    def __call__(self, batch):
        x = jnp.take(self.table[...], batch["inputs"], axis=0)
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w) for w in self.wqkv[...])
        x = x + jnp.einsum("bshk,hkd->bsd", attention.causal_attention(q, k, v), self.wo[...])
        return tensor.vocab_parallel_cross_entropy(x, self.head[...], batch["targets"])


def test_a_model_with_its_own_embedding_is_refused():
    model = describe(lambda: OwnEmbedding(nnx.Rngs(0)))
    plan = make_plan("context=2")
    step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
    tokens = jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(ValueError, match=r"ran its own embedding lookup \(jaxpar.embedding_lookup\)"):
        step.lower(abstract_state(model, OPTIMIZER, plan), {"inputs": tokens, "targets": tokens})


def test_a_model_without_jaxpar_attention_is_warned_that_context_only_splits_by_annotation():
    model = describe(lambda: ResidualMLP(nnx.Rngs(0)))
    plan = make_plan("context=2")
    step = make_train_step(model, lambda m, b: jnp.mean(m(b["x"]) ** 2), OPTIMIZER, plan)
    with pytest.warns(PlanOptionUnused, match="ran none of jaxpar's context-parallel layers"):
        step.lower(abstract_state(model, OPTIMIZER, plan), {"x": jnp.zeros((4, 16, 32))})


def test_default_rules_split_the_sequence_over_context():
    assert rules.DEFAULT_RULES["seq"] == rules.DEFAULT_RULES["seq_residual"] == "context"


def model_config(**overrides):
    return type(CONFIG)(**{**CONFIG.__dict__, **overrides})


def reference_model(**overrides):
    from jaxpar.models.llama import Llama

    return Llama(model_config(**overrides), nnx.Rngs(0))


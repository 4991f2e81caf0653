"""A user's own model built from jaxpar's public blocks trains on packed documents as the built-in Llama does.

The model calls `jaxpar.embedding_lookup`, `jaxpar.causal_attention`, its own rotary embedding at
`jaxpar.parallel.attention.positions` and `jaxpar.vocab_parallel_cross_entropy`; nothing in it knows about
documents. Packed rows on a sharded plan must give the loss and gradients of the same module run on each
document alone, without a plan, weighted by its targets (the reference).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from helpers import max_relative_error
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention
from jaxpar.data.packing import Document, as_batch, pack
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step

SEQ, VOCAB, LR = 16, 64, 0.5


def rope(x, positions):
    """The user's own rotary embedding of [b, s, heads, hd] at positions [s] or [b, s]."""
    half = x.shape[-1] // 2
    angles = jnp.asarray(positions).reshape(-1, x.shape[1])[..., None] * (1e4 ** (-jnp.arange(half) / half))
    sin, cos = jnp.sin(angles)[:, :, None], jnp.cos(angles)[:, :, None]
    return jnp.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


class UserLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d=16, heads=4, head_dim=4):
        init = nnx.initializers.normal(0.3)
        self.table = nnx.Param(nnx.with_partitioning(init, ("vocab", "embed"))(rngs.params(), (VOCAB, d)))
        self.wqkv = nnx.Param(nnx.with_partitioning(init, (None, "embed", "heads", "head_dim"))(
            rngs.params(), (3, d, heads, head_dim)))
        self.wo = nnx.Param(nnx.with_partitioning(init, ("heads", "head_dim", "embed"))(
            rngs.params(), (heads, head_dim, d)))
        self.head = nnx.Param(nnx.with_partitioning(init, ("embed", "vocab"))(rngs.params(), (d, VOCAB)))

    def __call__(self, batch):
        x = jaxpar.embedding_lookup(batch["inputs"], self.table[...])
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, w) for w in self.wqkv[...])
        positions = attention.positions(x.shape[1])
        q, k = rope(q, positions), rope(k, positions)
        x = x + jnp.einsum("bshk,hkd->bsd", jaxpar.causal_attention(q, k, v), self.wo[...])
        return jaxpar.vocab_parallel_cross_entropy(x, self.head[...], batch["targets"])


def documents():
    rng = np.random.default_rng(0)
    return [Document(rng.integers(1, VOCAB, n)) for n in (9, 5, 14, 3, 7, 11, 6, 12, 4, 8)]


def reference_loss(params, graphdef, docs):
    """Each document alone (its own row, no padding, no plan): the mean of its targets, weighted by their count."""
    model = nnx.merge(graphdef, nnx.State(params))
    total = sum(len(d.tokens) - 1 for d in docs)
    losses = [model({"inputs": jnp.asarray(d.tokens[None, :-1]), "targets": jnp.asarray(d.tokens[None, 1:])})
              * (len(d.tokens) - 1) for d in docs]
    return sum(losses) / total


@pytest.fixture(scope="module")
def expected():
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(UserLM(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: reference_loss(p, graphdef, documents())))(params)
    return float(loss), jax.tree.map(lambda p, g: np.asarray(p - LR * g), params, grads)


@pytest.mark.parametrize("mesh, options", [("data=2,context=4", {"context_form": "ring"}),
                                           ("data=4,tensor=2", {})])
def test_packed_documents_match_each_document_alone(expected, mesh, options):
    rows = as_batch(pack(documents(), SEQ))
    pad = -len(rows["inputs"]) % 4  # whole rows of padding (segment 0, weight 0), so the rows split over data
    rows = {k: np.concatenate([v, np.zeros((pad, SEQ), v.dtype)]) for k, v in rows.items()}
    assert (rows["segment_ids"].max(axis=1) > 1).any()  # rows hold several documents
    plan = Plan.create(mesh, **options)
    optimizer = optax.sgd(LR)
    model, state = init_state(lambda: UserLM(nnx.Rngs(0)), optimizer, plan)
    state = place_state(state, model, optimizer, plan)
    state, metrics = make_train_step(model, lambda m, b: m(b), optimizer, plan)(state, rows)
    loss, updated = expected
    assert max_relative_error(float(metrics["loss"]), loss) <= 1e-5
    assert max_relative_error(jax.device_get(state.params), updated) <= 1e-5

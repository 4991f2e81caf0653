"""Attention options (sliding window, logit soft cap, query scale) and packed documents, in every form.

The reference below is its own few lines of masked softmax attention (Hugging Face's semantics:
query i sees key j iff j <= i and i - j < window; scores * scale, then c * tanh(scores / c), then
the mask), sharing no code with jaxpar; packed rows are checked against each document attended
alone by it. The model-level checks run tests/reference.py's parts with per-layer windows. The
context forms run under data=2,context=4 and with the heads over tensor; each case compiles once.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference as ref
from helpers import copy_state, gradients, max_relative_error, reference_state, single_device_plan
from jaxpar.models import inference, layer_pattern, llama
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention, attention_ring, documents
from jaxpar.train.state import abstract_state
from jaxpar.train.step import make_train_step

OPTIONS = [
    {"window": 5},
    {"window": 1},
    {"softcap": 1.5, "scale": 0.6},
    {"window": 10, "softcap": 2.0, "scale": 0.25},
]
OPTION_IDS = ["-".join(f"{k}={v}" for k, v in o.items()) for o in OPTIONS]


def reference_attention(q, k, v, window=None, softcap=None, scale=None):
    """Masked softmax attention in plain JAX (tests/reference.py): q [b, s, heads, d], k and v [b, s, kv_heads, d]."""
    return ref.masked_attention(q, k, v, window=window, softcap=softcap, scale=scale)


@pytest.fixture(scope="module")
def inputs():
    keys = iter(jax.random.split(jax.random.key(7), 4))
    q = jax.random.normal(next(keys), (4, 32, 4, 8))
    k, v = (jax.random.normal(next(keys), (4, 32, 2, 8)) for _ in range(2))
    return q, k, v, jax.random.normal(next(keys), q.shape)


def value_and_grads(attend, q, k, v, weights):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v) * weights), argnums=(0, 1, 2)))(q, k, v)


@pytest.fixture(scope="module")
def reference_of(inputs):
    """options -> the reference's (value, grads) on `inputs`, each computed once."""
    done = {}

    def get(options: dict):
        key = tuple(sorted(options.items()))
        if key not in done:
            done[key] = jax.device_get(value_and_grads(functools.partial(reference_attention, **options), *inputs))
        return done[key]

    return get


def relative_errors(got, want) -> tuple[float, float]:
    (value, grads), (ref_value, ref_grads) = got, want
    return abs(float(value) / float(ref_value) - 1), max_relative_error(grads, ref_grads)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_plain_form_matches_reference_forward_and_backward(inputs, reference_of, options):
    got = jax.device_get(value_and_grads(functools.partial(attention.causal_attention, **options), *inputs))
    value_error, grad_error = relative_errors(got, reference_of(options))
    assert value_error <= 1e-5 and grad_error <= 1e-5, (value_error, grad_error)


def test_the_options_change_the_result(reference_of):
    """The reference itself tells the options apart (so the comparisons above test them)."""
    plain = reference_of({})[0]
    assert all(abs(float(reference_of(o)[0]) - float(plain)) > 1e-3 * abs(float(plain)) for o in OPTIONS)


def test_window_of_the_whole_sequence_is_global(inputs):
    q, k, v, _ = inputs
    assert np.array_equal(attention.causal_attention(q, k, v, window=32), attention.causal_attention(q, k, v))


@pytest.mark.parametrize("bad, match", [({"window": 0}, "window must be None or an int >= 1"),
                                        ({"window": 2.5}, "window must be"),
                                        ({"softcap": 0.0}, "softcap must be"), ({"scale": -1.0}, "scale must be")])
def test_bad_options_are_refused(inputs, bad, match):
    q, k, v, _ = inputs
    with pytest.raises(ValueError, match=match):
        attention.causal_attention(q, k, v, **bad)


# -- context parallelism: both forms, alone with data and with the heads over tensor -------------------------------

CONTEXT_CASES = [
    ("data=2,context=4", "all-gather", {"window": 10, "softcap": 2.0, "scale": 0.25}),
    ("data=2,context=4", "ring", {"window": 10, "softcap": 2.0, "scale": 0.25}),
    ("data=2,context=4", "ring", {"window": 5}),  # ring step 2 is hidden from every rank: skipped
    # heads over tensor (no data axis: jax >= 0.12 refuses context x tensor annotation inside a data shard_map)
    ("context=2,tensor=2", "all-gather", {"window": 6, "softcap": 1.5}),
    ("context=2,tensor=2", "ring", {"window": 6, "softcap": 1.5}),
]
CONTEXT_IDS = [f"{mesh}-{form}-" + "-".join(f"{k}={v}" for k, v in o.items()) for mesh, form, o in CONTEXT_CASES]


def context_value_and_grads(mesh: str, form: str, options: dict, inputs):
    """(value, grads) under the plan, the inputs in its sequence order and the gradients back in natural order."""
    size = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    plan = Plan.create(mesh, devices=jax.devices()[:size], context_form=form)
    with plan.activate():
        order = np.asarray(attention.positions(inputs[0].shape[1]))
        value, grads = jax.device_get(value_and_grads(functools.partial(attention.causal_attention, **options),
                                                      *(x[:, order] for x in inputs)))
    inverse = np.argsort(order)
    return value, tuple(g[:, inverse] for g in grads)


@pytest.mark.parametrize("mesh, form, options", CONTEXT_CASES, ids=CONTEXT_IDS)
def test_context_forms_match_reference_forward_and_backward(inputs, reference_of, mesh, form, options):
    got = context_value_and_grads(mesh, form, options, inputs)
    value_error, grad_error = relative_errors(got, reference_of(options))
    assert value_error <= 1e-5 and grad_error <= 1e-5, (value_error, grad_error)


@pytest.mark.parametrize("ways, chunk, window", [(4, 4, 10), (4, 4, 5), (4, 3, 1), (8, 2, 7), (3, 5, None), (2, 4, 6)])
def test_ring_block_plan_is_what_the_mask_says(ways, chunk, window):
    """Each rank's static plan per step names exactly the visible (query chunk, key chunk) pairs."""
    order = attention.balanced_order(2 * ways * chunk, ways).reshape(ways, 2, chunk)
    plan = attention_ring.block_plan(ways, chunk, window)
    for step in range(1, ways):
        for rank in range(ways):
            queries, keys = order[rank], order[(rank - step) % ways]
            seen = [[(q[:, None] >= k[None, :]) & ((q[:, None] - k[None, :] < window) if window else True)
                     for k in keys] for q in queries]
            fold = plan[step][rank]
            assert fold.keys == tuple(tuple(i for i in range(2) if row[i].any()) for row in seen)


# -- packed documents: attention never crosses a document boundary, in every form ---------------------------------

LAYOUT = [[10, 7, 11], [5, 20, 3], [32], [1, 2, 25]]  # each row's documents, padding after them (segment 0)
PACKED_CASES = [
    (None, None, {"window": 6, "softcap": 2.0}),
    ("data=2,context=4", "all-gather", {"window": 6, "softcap": 2.0}),
    ("data=2,context=4", "ring", {"window": 6, "softcap": 2.0}),  # blocks the window cuts or hides, per rank
    ("tensor=2", None, {}),
    ("context=2,tensor=2", "ring", {}),  # whole blocks, masked by the documents only
]
PACKED_IDS = [f"{mesh or 'plain'}-{form or ''}-" + "-".join(f"{k}={v}" for k, v in o.items())
              for mesh, form, o in PACKED_CASES]


def packed_segment_ids(seq: int = 32) -> np.ndarray:
    ids = np.zeros((len(LAYOUT), seq), np.int32)
    for row, lengths in enumerate(LAYOUT):
        ends = np.cumsum(lengths)
        for doc, (start, end) in enumerate(zip(ends - lengths, ends)):
            ids[row, start:end] = doc + 1
    return ids


def reference_packed(q, k, v, **options):
    """Each document of each row attended alone by `reference_attention`; padding rows give 0."""
    rows = []
    for row, lengths in enumerate(LAYOUT):
        parts, start = [], 0
        for n in lengths:
            span = slice(start, start + n)
            parts.append(reference_attention(q[row:row + 1, span], k[row:row + 1, span], v[row:row + 1, span],
                                             **options))
            start += n
        parts.append(jnp.zeros_like(q[row:row + 1, start:]))
        rows.append(jnp.concatenate(parts, axis=1))
    return jnp.concatenate(rows, axis=0)


def packed_value_and_grads(mesh, form, options, inputs):
    """causal_attention under `documents.scope` (segment ids in natural order, the activations in the plan's)."""
    segments = jnp.asarray(packed_segment_ids(inputs[0].shape[1]))

    def loss(q, k, v, weights, segments):
        with documents.scope({"segment_ids": segments}):
            return jnp.sum(attention.causal_attention(q, k, v, **options) * weights)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    if mesh is None:
        return jax.device_get(run(*inputs, segments))
    size = int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))
    plan = Plan.create(mesh, devices=jax.devices()[:size], **({"context_form": form} if form else {}))
    with plan.activate():
        order = np.asarray(attention.positions(inputs[0].shape[1]))
        value, grads = jax.device_get(run(*(x[:, order] for x in inputs), segments))
    return value, tuple(g[:, np.argsort(order)] for g in grads)


@pytest.fixture(scope="module")
def packed_reference_of(inputs):
    """options -> the per-document reference's (value, grads) on `inputs`, each computed once."""
    done = {}

    def get(options: dict):
        key = tuple(sorted(options.items()))
        if key not in done:
            done[key] = jax.device_get(value_and_grads(functools.partial(reference_packed, **options), *inputs))
        return done[key]

    return get


@pytest.mark.parametrize("mesh, form, options", PACKED_CASES, ids=PACKED_IDS)
def test_packed_documents_attend_as_if_alone(inputs, packed_reference_of, mesh, form, options):
    """Forward and gradients of a packed batch (3 documents + padding, one whole row, 1-token documents)
    equal those of each document alone; padding outputs 0, and no NaN anywhere."""
    want = packed_reference_of(options)
    got = packed_value_and_grads(mesh, form, options, inputs)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(got))
    value_error, grad_error = relative_errors(got, want)
    assert value_error <= 1e-5 and grad_error <= 1e-5, (value_error, grad_error)
    padding = packed_segment_ids() == 0
    assert not np.any(got[1][0][padding]), "a padding query's gradient (its output) must be 0"


def test_positions_are_the_documents_in_context_order():
    packed = jnp.asarray(np.tile(np.arange(16), (2, 1)) % 5)
    with documents.scope({"positions": packed}):
        assert np.array_equal(attention.positions(16), packed)
        with Plan.create("data=2,context=4").activate():
            assert np.array_equal(attention.positions(16), packed[:, attention.balanced_order(16, 4)])


def test_segment_ids_of_other_rows_are_refused(inputs):
    q, k, v, _ = inputs
    with documents.scope({"segment_ids": jnp.ones((2, 32), jnp.int32)}):
        with pytest.raises(ValueError, match=r"segment_ids have shape \(2, 32\), but attention runs on rows \[4, 32\]"):
            attention.causal_attention(q, k, v)


# -- the model: Mistral's uniform window and Gemma 2's alternating local/global layers ---------------------------

GEMMA_LIKE = llama.LlamaConfig(vocab=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                               seq_len=16, sliding_window=3, sliding_pattern=2, attn_softcap=2.0, query_scale=0.3)


def test_layer_pattern():
    assert [layer_pattern.layer_window(GEMMA_LIKE, i) for i in range(4)] == [3, None, 3, None]
    mistral = llama.LlamaConfig(sliding_window=5)
    assert [layer_pattern.layer_window(mistral, i) for i in range(4)] == [5] * 4
    assert layer_pattern.layer_config(mistral, 1) is mistral


@pytest.mark.parametrize("fields, match", [
    ({"sliding_pattern": 2}, "sliding_window is None"),
    ({"rope_local_theta": 100.0}, "rope_local_theta=100.0 rotates local layers apart from global ones"),
    ({"sliding_window": 0}, "sliding_window must be"),
    ({"sliding_pattern": 0}, "sliding_pattern must be"),
    ({"attn_softcap": -1.0}, "attn_softcap must be"),
])
def test_config_refuses_bad_attention_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        llama.LlamaConfig(**fields)


def reference_loss(params, batch, cfg):
    """The dense model with per-layer windows, soft cap and scale, from tests/reference.py's parts."""
    x = ref.embed(params, batch["inputs"])
    for i in range(cfg.n_layers):
        p = ref.layer(params["blocks"], i)
        h = ref.norm(x, p["attn_norm"], cfg.norm_eps)
        q, k, v = (jnp.einsum("bsd,dhk->bshk", h, p[w]) for w in ("wq", "wk", "wv"))
        q, k = ref.rope(q, cfg.rope_theta), ref.rope(k, cfg.rope_theta)
        window = cfg.sliding_window if (i + 1) % cfg.sliding_pattern else None
        out = reference_attention(q, k, v, window, cfg.attn_softcap, cfg.query_scale)
        x = x + jnp.einsum("bqhk,hkd->bqd", out, p["wo"])
        x = x + ref.swiglu(ref.norm(x, p["mlp_norm"], cfg.norm_eps), p["w_gate"], p["w_up"], p["w_down"])
    return ref.cross_entropy(params, x, batch["targets"], cfg)


@pytest.fixture(scope="module")
def gemma_like():
    """The model definition, its initial parameters and a batch."""
    model, state, _ = reference_state(GEMMA_LIKE)
    tokens = jax.random.randint(jax.random.key(1), (4, GEMMA_LIKE.seq_len + 1), 0, GEMMA_LIKE.vocab)
    return model, copy_state(state.params), {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.fixture(scope="module")
def gemma_like_reference(gemma_like):
    _, params, batch = gemma_like
    return jax.device_get(jax.jit(jax.value_and_grad(reference_loss), static_argnums=2)(params, batch, GEMMA_LIKE))


MODEL_PLANS = {
    "one-device": lambda: single_device_plan(),
    # each stage a contiguous pair of layers (local, global)
    "pipe=2-1f1b": lambda: Plan.create("pipe=2", devices=jax.devices()[:2], schedule="1f1b", microbatches=2),
    "data=2,context=4-ring": lambda: Plan.create("data=2,context=4", context_form="ring"),
}


@pytest.mark.parametrize("plan", ["one-device", *(pytest.param(p, marks=pytest.mark.slow)
                                                  for p in ("pipe=2-1f1b", "data=2,context=4-ring"))])
def test_layers_run_their_own_windows_forward_and_backward(gemma_like, gemma_like_reference, plan):
    model, params, batch = gemma_like
    loss, grads = gradients(model, params, batch, MODEL_PLANS[plan]())
    want_loss, want_grads = gemma_like_reference
    assert abs(float(loss) / float(want_loss) - 1) <= 1e-5
    assert max_relative_error(grads, want_grads) <= 1e-5


@pytest.mark.slow
def test_interleaved_pipeline_chunks_keep_the_global_layer_pattern():
    """pipe=2 x virtual_stages=2 on 8 layers: device i runs chunks i and i + 2 (layers 2i, 2i+1 and 2i+4, 2i+5),
    stored in pipeline order; each chunk starts a (local, global) pair, so every layer keeps its own window."""
    cfg = dataclasses.replace(GEMMA_LIKE, n_layers=8)
    model, state, _ = reference_state(cfg)
    params = copy_state(state.params)
    tokens = jax.random.randint(jax.random.key(2), (4, cfg.seq_len + 1), 0, cfg.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    want_loss, want_grads = jax.device_get(jax.jit(jax.value_and_grad(reference_loss), static_argnums=2)(
        params, batch, cfg))
    plan = Plan.create("pipe=2", devices=jax.devices()[:2], schedule="interleaved", microbatches=2, virtual_stages=2)
    loss, grads = gradients(model, params, batch, plan)
    assert abs(float(loss) / float(want_loss) - 1) <= 1e-5
    assert max_relative_error(grads, want_grads) <= 1e-5


def test_decode_with_a_window_equals_the_full_forward(gemma_like):
    """Token-by-token decode through the KV cache (keys beyond a local layer's window masked) gives the logits
    of the inference forward over the whole sequence, and those equal the training path's blocks."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(llama.Llama(GEMMA_LIKE, nnx.Rngs(0)))
    tokens = gemma_like[2]["inputs"][:2, :12]
    decode = jax.jit(lambda state, tokens, cache: nnx.merge(graphdef, state).decode(tokens, cache))

    @jax.jit
    def forwards(state, tokens):
        model = nnx.merge(graphdef, state)
        trained = inference.logits_of(model, llama.run_layers(model.blocks.stacked(), model.embed(tokens), GEMMA_LIKE))
        return model.logits(tokens), trained

    full, trained = forwards(state, tokens)
    assert max_relative_error(trained, full) <= 1e-5
    logits, cache = decode(state, tokens[:, :4], inference.init_cache(GEMMA_LIKE, 2, 12))
    steps = [logits]
    for t in range(4, 12):
        logits, cache = decode(state, tokens[:, t:t + 1], cache)
        steps.append(logits)
    assert max_relative_error(jnp.concatenate(steps, axis=1), full) <= 1e-5


def test_pipeline_chunks_that_would_break_the_layer_pattern_are_refused_before_compiling(gemma_like):
    """pipe=2 x virtual_stages=2 cuts 4 layers into chunks of 1: a chunk's first layer would not keep its
    global layer index's parity."""
    model, _, batch = gemma_like
    plan = Plan.create("pipe=2", devices=jax.devices()[:2], schedule="interleaved", microbatches=2, virtual_stages=2)
    step = make_train_step(model, lambda m, b: m(b), optax.sgd(0.1), plan)
    with pytest.raises(ValueError, match=r"chunk of 1 layers \(pipe=2 x virtual_stages=2 chunks\) is not a multiple "
                                         r"of sliding_pattern=2"):
        step.lower(abstract_state(model, optax.sgd(0.1), plan), batch)


def test_packed_rows_run_each_document_as_if_alone():
    """The model's blocks on packed rows (segment ids and per-document positions in the documents' scope:
    attention stays in each document, rotary embeddings restart) give each document the hidden states it
    has alone at the start of a row."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(llama.Llama(GEMMA_LIKE, nnx.Rngs(0)))
    docs = [np.arange(5) + 3, np.arange(7) + 20, (np.arange(16) * 7) % 64]
    filler = np.full(16, 1)
    packed = np.stack([np.concatenate([docs[0], docs[1], filler[:4]]), docs[2]])
    segments = np.array([[1] * 5 + [2] * 7 + [0] * 4, [1] * 16], np.int32)
    positions = np.array([list(range(5)) + list(range(7)) + [0] * 4, list(range(16))], np.int32)
    alone = np.stack([np.concatenate([d, filler[len(d):]]) for d in docs])

    @jax.jit
    def hidden(state, tokens, fields):
        model = nnx.merge(graphdef, state)
        with documents.scope(fields):
            return llama.run_layers(model.blocks.stacked(), model.embed(tokens), GEMMA_LIKE)

    got = hidden(state, jnp.asarray(packed), {"segment_ids": jnp.asarray(segments),
                                              "positions": jnp.asarray(positions)})
    want = hidden(state, jnp.asarray(alone), {})
    assert max_relative_error(got[0, :5], want[0, :5]) <= 1e-5
    assert max_relative_error(got[0, 5:12], want[1, :7]) <= 1e-5
    assert max_relative_error(got[1], want[2]) <= 1e-5
    assert np.isfinite(got).all()

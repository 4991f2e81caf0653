"""Packed documents at inference: a packed row's logits, a packed prompt's decode and the held-out figure of
packed rows each equal those of the documents run alone (fp32, 1e-5), on a small Gemma-2-like model
(a local layer with a sliding window, a global one, attention and final soft caps)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import max_relative_error, single_device_plan
from jaxpar.models.inference import init_cache
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.moe import MoeLlama, MoeLlamaConfig
from jaxpar.run.evaluate import Evaluator
from jaxpar.data.holdout import eval_documents
from jaxpar.data.packing import Document, as_batch, pack
from jaxpar.train.state import describe

CFG = LlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=24,
                  sliding_window=3, sliding_pattern=2, attn_softcap=2.0, query_scale=0.3, final_softcap=5.0)
DOCS = [np.array(d, np.int32) for d in ([5, 9, 3, 17, 2], [8, 1, 40, 33, 7, 21, 12], [4, 60, 11, 30, 6, 19])]
ROWS = ((0, 1, 2), (2, 0))  # the documents of each packed row, in order
SEQ, NEW = 24, 5  # packed row length (trailing padding), tokens decoded after the prompt


@pytest.fixture(scope="module")
def model():
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(Llama(CFG, nnx.Rngs(0)))
    return graphdef, state


def packed_rows():
    """tokens, segment ids [2, SEQ] (1, 2, ... per document, 0: padding) and where each document starts."""
    tokens, segments = np.zeros((2, SEQ), np.int32), np.zeros((2, SEQ), np.int32)
    starts = []
    for r, docs in enumerate(ROWS):
        at, row = 0, {}
        for s, d in enumerate(docs, 1):
            tokens[r, at:at + len(DOCS[d])], segments[r, at:at + len(DOCS[d])] = DOCS[d], s
            row[d], at = at, at + len(DOCS[d])
        starts.append(row)
    return tokens, segments, starts


def right_padded(docs):
    """The documents alone, one to a row, right-padded: tokens and mask."""
    width = max(len(DOCS[d]) for d in docs)
    tokens, mask = np.zeros((len(docs), width), np.int32), np.zeros((len(docs), width), bool)
    for r, d in enumerate(docs):
        tokens[r, :len(DOCS[d])], mask[r, :len(DOCS[d])] = DOCS[d], True
    return tokens, mask


def test_a_packed_row_gives_each_document_its_logits_alone(model):
    graphdef, state = model
    logits = jax.jit(lambda s, t, m=None, g=None: nnx.merge(graphdef, s).logits(t, mask=m, segment_ids=g))
    tokens, segments, starts = packed_rows()
    packed = np.asarray(logits(state, tokens, None, segments))
    alone_tokens, alone_mask = right_padded(range(len(DOCS)))
    alone = np.asarray(logits(state, alone_tokens, alone_mask))
    for r, row in enumerate(starts):
        for d, at in row.items():
            n = len(DOCS[d])
            assert max_relative_error(packed[r, at:at + n], alone[d, :n]) <= 1e-5
    # the same row without segment ids attends across documents: the masks act
    crossed = np.asarray(logits(state, tokens, segments > 0))
    assert max_relative_error(crossed[0, 5:12], alone[1, :7]) > 1e-3
    assert np.isfinite(packed).all()  # padding queries see nothing and give finite logits


def greedy(graphdef, prefill_cache, segmented: bool):
    """A jitted (state, tokens, mask_or_segments) -> (new tokens [b, NEW], logits of each step [b, NEW, vocab])."""

    @jax.jit
    def run(state, tokens, marks):
        model = nnx.merge(graphdef, state)
        cache = prefill_cache(tokens.shape[0])
        if segmented:
            logits, cache = model.decode(tokens, cache, segment_ids=marks)
        else:
            logits, cache = model.decode(tokens, cache, marks)
        last = jnp.take_along_axis(logits, prompt_ends(marks)[:, None, None], axis=1)[:, 0] if segmented \
            else logits[:, -1]

        def step(carry, _):
            cache, last = carry
            token = jnp.argmax(last, axis=-1).astype(jnp.int32)
            logits, cache = model.decode(token[:, None], cache)
            return (cache, logits[:, -1]), (token, last)

        _, (new, steps) = jax.lax.scan(step, (cache, last), None, length=NEW)
        return new.T, jnp.swapaxes(steps, 0, 1)

    return run


def prompt_ends(segments):
    """Each row's last real token index (its packed prompt's end; padding follows)."""
    real = segments > 0
    return real.shape[1] - 1 - jnp.argmax(real[:, ::-1], axis=1)


def test_decode_after_a_packed_prompt_continues_the_last_document_alone(model):
    graphdef, state = model
    tokens, segments, _ = packed_rows()
    slots = SEQ + NEW
    packed = greedy(graphdef, lambda b: init_cache(CFG, b, slots, segments=True), True)(state, tokens, segments)
    last = [docs[-1] for docs in ROWS]
    width = max(len(DOCS[d]) for d in last)
    alone_tokens, alone_mask = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
    for r, d in enumerate(last):  # left-padded, as jaxpar generate pads prompts
        alone_tokens[r, width - len(DOCS[d]):], alone_mask[r, width - len(DOCS[d]):] = DOCS[d], True
    alone = greedy(graphdef, lambda b: init_cache(CFG, b, width + NEW), False)(state, alone_tokens, alone_mask)
    np.testing.assert_array_equal(packed[0], alone[0])
    assert max_relative_error(packed[1], alone[1]) <= 1e-5


def test_segment_ids_are_checked(model):
    graphdef, state = model
    m = nnx.merge(graphdef, state)
    tokens = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 5\); it must match tokens \[batch, seq\] = "
                                         r"\(2, 6\)"):
        m.logits(tokens, segment_ids=jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"needs a cache that keeps each slot's segment"):
        m.decode(tokens, init_cache(CFG, 2, 8), segment_ids=jnp.ones((2, 6), jnp.int32))


def test_packed_held_out_rows_give_the_one_document_per_row_figure(model):
    """`eval_documents` packs the held-out documents (fewer rows); the weighted loss sum(w nll) / sum(w) equals the
    figure of the documents one to a row, with a fine-tuning record's mask and a document longer than a row."""
    graphdef, state = model
    rng = np.random.default_rng(0)
    docs = [Document(rng.integers(0, CFG.vocab, n).astype(np.int32)) for n in (5, 9, 3, 30, 7, 4)]
    docs[1] = Document(docs[1].tokens, (np.arange(9) >= 4).astype(np.float32))  # a record: its completion only
    seq_len, batch_size = 16, 2
    windows = eval_documents(docs, seq_len, batch_size)
    alone = as_batch(pack(docs, seq_len, alone=True))
    assert windows["inputs"].shape[0] < alone["inputs"].shape[0]

    @jax.jit
    def weighted_sum(state, batch):
        logits = nnx.merge(graphdef, state).logits(batch["inputs"], batch["positions"], batch["segment_ids"] > 0)
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * batch["loss_weights"]), jnp.sum(batch["loss_weights"])

    total, count = weighted_sum(state, alone)
    with nnx.use_eager_sharding(False):
        model_def = describe(lambda: Llama(CFG, nnx.Rngs(0)))
    figures = Evaluator(model_def, single_device_plan(), windows, batch_size)(state)
    assert figures["eval_tokens"] == int(count)
    assert abs(figures["eval_loss"] / (float(total) / float(count)) - 1) <= 1e-5


def test_an_moe_model_packs_and_decodes_documents_too():
    """The MoE blocks' inference hook (`Blocks.inference`) runs under segment ids: dropless routing is per token,
    so a packed row and a packed prompt's continuation equal the documents alone."""
    cfg = MoeLlamaConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                         expert_d_ff=32, n_experts=4, top_k=2, moe_every=1, dropless=True, seq_len=16)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoeLlama(cfg, nnx.Rngs(0)))
    first, last = DOCS[0], DOCS[1]
    tokens, segments = np.zeros((1, 14), np.int32), np.zeros((1, 14), np.int32)
    tokens[0, :5], segments[0, :5], tokens[0, 5:12], segments[0, 5:12] = first, 1, last, 2
    alone = np.zeros((2, 8), np.int32)
    alone[0, :5], alone[1] = first, np.concatenate([last, [21]])

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        packed = model.logits(tokens, segment_ids=segments)
        _, cache = model.decode(tokens, init_cache(cfg, 1, 15, segments=True), segment_ids=segments)
        logits, cache = model.decode(jnp.array([[21]], jnp.int32), cache)
        return packed, logits, cache["length"], cache["segment"], model.logits(alone, mask=alone > 0)

    packed, logits, length, segment, alone_logits = run(state)
    assert max_relative_error(packed[0, :5], alone_logits[0, :5]) <= 1e-5
    assert max_relative_error(packed[0, 5:12], alone_logits[1, :7]) <= 1e-5
    assert max_relative_error(logits[0, 0], alone_logits[1, 7]) <= 1e-5
    assert (int(length[0]), int(segment[0])) == (8, 2)

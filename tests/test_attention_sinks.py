"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator) in every form of
jaxpar's causal attention that can carry them, against the plain masked softmax of tests/reference.py
(which appends the sink as one more column and drops it after the softmax), values and the gradients of
q, k, v and the sinks; and the forms that cannot carry them refused or avoided by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_relative_error
from reference import masked_attention as reference
from jaxpar.core import usage
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention, attention_kernels, documents
from jaxpar.parallel.attention_math import Scoring

TOLERANCE = 1e-6  # fp32, relative (norm-wise per leaf)
H100 = "NVIDIA H100 80GB HBM3"


def inputs(batch=2, seq=37, heads=4, kv_heads=2, head_dim=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    sinks = 2.0 * jax.random.normal(keys[3], (heads,))  # large enough that the sink takes a real share of each row
    return (q, k, v, sinks), jax.random.normal(keys[4], (batch, seq, heads, head_dim))


def value_and_grads(attend, args, weights):
    out, pullback = jax.vjp(attend, *args)
    return jax.device_get((out, pullback(weights)))


def segments_of(batch, seq):
    """Two documents per row and two padding tokens at the end."""
    ids = np.ones((batch, seq), np.int32)
    ids[:, seq // 3:] = 2
    ids[:, -2:] = 0
    return jnp.asarray(ids)


CASES = {  # name: (plan's attention, blocks, options, packed documents, kv heads)
    "xla": ("xla", "", {}, False, 2),
    "flash": ("flash", "8,16", {}, False, 2),
    "flash-window-gqa": ("flash", "8,8", {"window": 7}, False, 1),
    "flash-documents-softcap": ("flash", "8,16", {"softcap": 3.0, "scale": 0.3}, True, 2),
    "xla-documents-window": ("xla", "", {"window": 5}, True, 2),
    "auto": ("auto", "", {"window": 9}, False, 2),
}


@pytest.mark.parametrize("name", CASES)
def test_sinks_match_the_reference_with_gradients(name):
    """Values and the gradients of q, k, v and the sinks within 1e-6 of the reference, on 37 tokens (flash in
    small blocks: padded tails, skipped pairs); padding rows of packed documents give exactly 0."""
    asked, blocks, options, packed, kv_heads = CASES[name]
    args, weights = inputs(kv_heads=kv_heads)
    segments = segments_of(2, 37) if packed else None

    def attend(q, k, v, sinks):
        with documents.scope({} if segments is None else {"segment_ids": segments}):
            return attention.causal_attention(q, k, v, sinks=sinks, **options)

    plan = Plan.create("data=1", devices=jax.devices()[:1], attention=asked, attention_blocks=blocks)
    with plan.activate(), usage.recording() as used:
        got = value_and_grads(attend, args, weights)
    assert [c.split(" ")[0] for c in attention_kernels.choices(used)] == ["xla" if asked == "xla" else "flash"]
    def plain(q, k, v, sinks):
        return reference(q, k, v, segments, sinks=sinks, **options)

    want = value_and_grads(plain, args, weights)
    errors = [max_relative_error(got[0], want[0])] + [max_relative_error(a, b) for a, b in zip(got[1], want[1])]
    assert max(errors) <= TOLERANCE, errors
    if packed:
        assert not np.any(got[0][np.asarray(segments) == 0])


def test_sinks_change_the_output():
    """The sinks act: the output without them differs by more than 1e-3 (so the tests above test something)."""
    (q, k, v, sinks), _ = inputs()
    with_sinks = attention.causal_attention(q, k, v, sinks=sinks)
    assert max_relative_error(attention.causal_attention(q, k, v), with_sinks) > 1e-3


def test_auto_keeps_fused_kernels_from_sinks_and_says_why():
    call = attention_kernels.Call(jnp.bfloat16, 128, 128, False, Scoring(), 1, sinks=True)
    name, why = attention_kernels.choose(call, device_kind=H100)
    assert name == "flash" and "attention sinks" in why
    assert attention_kernels.choose(call, device_kind="TPU v5p")[0] == "flash"


@pytest.mark.parametrize("asked", ["cudnn", "pallas", "splash"])
def test_a_forced_fused_kernel_is_refused_with_sinks(asked):
    (q, k, v, sinks), _ = inputs(seq=16)
    with Plan.create("data=1", devices=jax.devices()[:1], attention=asked).activate():
        with pytest.raises(ValueError, match=f"attention='{asked}' cannot run this attention: attention sinks"):
            attention.causal_attention(q, k, v, sinks=sinks)


def test_sinks_of_a_wrong_shape_are_refused():
    """(Under context parallelism sinks run: tests/test_context_parallel.py.)"""
    (q, k, v, sinks), _ = inputs(seq=16)
    with pytest.raises(ValueError, match=r"expected one logit per query head, \(4,\)"):
        attention.causal_attention(q, k, v, sinks=sinks[:2])

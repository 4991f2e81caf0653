"""Flash attention (jaxpar.parallel.attention_flash) against the textbook masked softmax, the choice of
implementation per call (jaxpar.parallel.attention_kernels), and the GPU profile of XLA flags.

The reference is its own few lines of plain JAX (K/V heads repeated, the whole [seq, seq] mask), sharing
no code with jaxpar. Blocks are small here (a few rows) so that every path of the blockwise loop runs:
several query and key blocks, skipped pairs, padded tails, documents crossing block boundaries.
"""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_relative_error
from reference import masked_attention as reference
from jaxpar.core import gpu_profile, usage
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention, attention_kernels, documents
from jaxpar.parallel.attention_flash import Blocks, flash_attention
from jaxpar.parallel.attention_math import Scoring
from jaxpar.planner.activations import scores_kept
from jaxpar.planner.layout import Layout

TOLERANCE = 1e-6  # fp32, relative (norm-wise per leaf)


def documents_crossing_blocks(batch: int, seq: int) -> np.ndarray:
    """Segment ids with documents of 1 to 13 tokens (crossing every block boundary) and padding at each row's end."""
    rng = np.random.default_rng(3)
    ids = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        start, doc = 0, 1
        while start < seq - 4 - row:
            length = int(rng.integers(1, 14))
            ids[row, start:min(start + length, seq - 4 - row)] = doc
            start, doc = start + length, doc + 1
    return ids


def inputs(batch=2, seq=37, heads=4, kv_heads=2, head_dim=16, value_dim=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, value_dim or head_dim))
    return q, k, v, jax.random.normal(keys[3], (batch, seq, heads, value_dim or head_dim))


def value_and_grads(attend, q, k, v, weights):
    """The output and the gradients of q, k, v for the output's cotangent `weights`."""
    def run(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(weights)

    return jax.device_get(jax.jit(run)(q, k, v))


def errors(got, want) -> tuple[float, float]:
    """Norm-wise relative errors of the output and of the gradients."""
    return max_relative_error(got[0], want[0]), max_relative_error(got[1], want[1])


CASES = {  # name: (shape of the inputs, options, packed documents)
    "plain": ({}, {}, False),
    "gqa-4-to-1": ({"heads": 4, "kv_heads": 1}, {}, False),
    "window": ({}, {"window": 7}, False),
    "softcap-scale": ({}, {"softcap": 2.0, "scale": 0.3}, False),
    "documents-padding": ({}, {}, True),
    "documents-window-softcap": ({}, {"window": 5, "softcap": 3.0}, True),
    "head-dim-64": ({"head_dim": 64, "heads": 2, "kv_heads": 1}, {}, False),
    "head-dim-128": ({"head_dim": 128, "heads": 2, "kv_heads": 1}, {"window": 9}, False),
    "head-dim-256": ({"head_dim": 256, "heads": 2, "kv_heads": 2}, {}, True),
    "value-dim-24": ({"value_dim": 24}, {"window": 11}, False),
    "window-1": ({}, {"window": 1}, True),
}


@pytest.mark.parametrize("name", CASES)
def test_flash_matches_the_masked_softmax(name):
    """Values and gradients within 1e-6 on 37 tokens in blocks of 8 queries x 16 keys (a padded tail)."""
    shape, options, packed = CASES[name]
    q, k, v, weights = inputs(**shape)
    segments = jnp.asarray(documents_crossing_blocks(q.shape[0], q.shape[1])) if packed else None
    pos = np.arange(q.shape[1])
    scoring = Scoring(**options)
    def flash(q, k, v):
        return flash_attention(q, k, v, pos, pos, scoring, segments, segments, Blocks(8, 16))[0]

    got = value_and_grads(flash, q, k, v, weights)
    want = value_and_grads(functools.partial(reference, segments=segments, **options), q, k, v, weights)
    value_error, grad_error = errors(got, want)
    assert value_error <= TOLERANCE and grad_error <= TOLERANCE, (value_error, grad_error)
    if packed:
        padding = np.asarray(segments) == 0
        assert not np.any(got[1][0][padding]) and np.all(np.isfinite(got[1][0]))


def test_run_time_skipping_equals_the_static_table():
    """Traced positions (every pair in the loop, hidden ones skipped by a cond) give the static table's result."""
    q, k, v, weights = inputs()
    pos = np.arange(q.shape[1])
    scoring = Scoring(window=6)
    static = value_and_grads(lambda q, k, v: flash_attention(q, k, v, pos, pos, scoring, blocks=Blocks(8, 8))[0],
                             q, k, v, weights)
    traced = value_and_grads(lambda q, k, v: flash_attention(q, k, v, jnp.asarray(pos), jnp.asarray(pos), scoring,
                                                             blocks=Blocks(8, 8))[0], q, k, v, weights)
    assert errors(traced, static)[0] <= 1e-7 and errors(traced, static)[1] <= 1e-7


def largest_array(jaxpr) -> int:
    sizes = [math.prod(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars if hasattr(v.aval, "shape")]
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sizes.append(largest_array(sub))
    return max(sizes)


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_no_seq_by_seq_array_in_forward_or_backward(policy):
    """At 256 tokens in blocks of 32, nothing in the differentiated step (under ZeRO-3's remat policy too, which
    saves matmul outputs) holds a [seq, seq] array per head: the largest is one block pair's scores."""
    seq, heads = 256, 4
    q, k, v, weights = inputs(batch=1, seq=seq, heads=heads, kv_heads=2)
    pos = np.arange(seq)

    def attend(q, k, v):
        return flash_attention(q, k, v, pos, pos, Scoring(), blocks=Blocks(32, 32))[0]

    if policy:
        attend = jax.checkpoint(attend, policy=getattr(jax.checkpoint_policies, policy))
    jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * weights), argnums=(0, 1, 2)))(q, k, v)
    assert largest_array(jaxpr.jaxpr) < heads * seq * seq // 4


# -- context parallelism: both forms attend their local blocks with flash attention ----------------------------------

@pytest.mark.parametrize("form", ["all-gather", "ring"])
def test_context_forms_with_small_blocks(form):
    """Under data=2,context=4 with blocks of 4 (each rank's 2 x 8-token chunks in several blocks), packed documents
    crossing blocks, a window and a soft cap: values and gradients equal the reference's."""
    q, k, v, weights = inputs(batch=2, seq=64)
    segments = documents_crossing_blocks(2, 64)
    options = {"window": 13, "softcap": 2.5}

    def attend(q, k, v, segments):
        with documents.scope({"segment_ids": segments}):
            return attention.causal_attention(q, k, v, **options)

    want = value_and_grads(functools.partial(reference, segments=jnp.asarray(segments), **options), q, k, v, weights)
    plan = Plan.create("data=2,context=4", devices=jax.devices()[:8], context_form=form, attention_blocks="4,4")
    with plan.activate():
        order = np.asarray(attention.positions(64))
        value, grads = value_and_grads(lambda q, k, v: attend(q, k, v, jnp.asarray(segments)),
                                       *(x[:, order] for x in (q, k, v, weights)))
    inverse = np.argsort(order)
    got = (value[:, inverse], tuple(g[:, inverse] for g in grads))
    value_error, grad_error = errors(got, want)
    assert value_error <= TOLERANCE and grad_error <= TOLERANCE, (value_error, grad_error)


# -- which implementation each call gets -----------------------------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"


def call(**changes):
    fields = {"dtype": jnp.bfloat16, "head_dim": 128, "value_dim": 128, "segments": False, "scoring": Scoring(),
              "context_ways": 1, **changes}
    return attention_kernels.Call(**fields)


@pytest.mark.parametrize("changes, why", [
    ({"segments": True}, "segment ids"), ({"scoring": Scoring(softcap=30.0)}, "soft cap"),
    ({"dtype": jnp.float32}, "float32"), ({"context_ways": 2}, "context parallelism"),
    ({"value_dim": 64}, "value head dimension"), ({"head_dim": 256, "value_dim": 256}, "head dimension 256"),
])
def test_auto_keeps_cudnn_from_what_it_cannot_honour(changes, why):
    """Packed documents or a soft cap never reach cuDNN (a fused path that drops segment ids trains on the wrong
    loss); neither do fp32, context's reordered chunks, a value dimension of its own or too large a head (they go
    to the Pallas kernel or flash attention: tests/test_attention_pallas.py)."""
    name, reason = attention_kernels.choose(call(**changes), device_kind=H100)
    assert name in ("pallas", "flash") and why in reason


def test_auto_takes_cudnn_where_it_applies_and_flash_off_nvidia():
    assert attention_kernels.choose(call(), device_kind=H100)[0] == "cudnn"
    assert attention_kernels.choose(call(scoring=Scoring(window=4096)), device_kind=H100)[0] == "cudnn"
    name, reason = attention_kernels.choose(call(), device_kind="cpu")
    assert name == "flash" and "NVIDIA" in reason


def test_a_forced_implementation_is_refused_with_the_reason_or_obeyed():
    q, k, v, _ = inputs(seq=16)
    with Plan.create("data=1", devices=jax.devices()[:1], attention="cudnn").activate():
        with pytest.raises(ValueError, match="attention='cudnn' cannot run this attention: the device is cpu"):
            attention.causal_attention(q, k, v)
    for asked in ("xla", "flash"):
        with Plan.create("data=1", devices=jax.devices()[:1], attention=asked).activate(), usage.recording() as used:
            out = attention.causal_attention(q, k, v, window=5)
        assert [c.split(" ")[0] for c in attention_kernels.choices(used)] == [asked]
        np.testing.assert_allclose(out, reference(q, k, v, window=5), rtol=1e-5, atol=1e-6)


def test_bad_attention_options_are_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        Plan.create("data=1", devices=jax.devices()[:1], attention="fast")
    with pytest.raises(ValueError, match="attention_blocks must be 'Q,K' or 'N'"):
        Plan.create("data=1", devices=jax.devices()[:1], attention_blocks="512x512")
    with pytest.raises(ValueError, match="attention='xla' runs no flash attention"):
        Plan.create("data=1", devices=jax.devices()[:1], attention="xla", attention_blocks="256,256")


def test_the_planner_keeps_scores_only_for_the_plain_softmax():
    assert scores_kept(Layout(data=8), 4096) == 0
    assert scores_kept(Layout(data=8, attention="xla"), 4096) == 4096
    assert scores_kept(Layout(data=2, context=4, attention="xla"), 4096) == 0


# -- the GPU profile ---------------------------------------------------------------------------------------------------

def test_gpu_profile_adds_its_flags_on_nvidia_and_keeps_the_users(monkeypatch):
    monkeypatch.setattr(gpu_profile, "nvidia_gpu_in_use", lambda: True)
    environ = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"}
    added = gpu_profile.apply("auto", environ)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in added and len(added) == len(gpu_profile.FLAGS) - 1
    assert environ["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x ")
    assert "--xla_gpu_enable_while_loop_double_buffering=true" in environ["XLA_FLAGS"]
    untouched = {"XLA_FLAGS": "--a=1"}
    assert gpu_profile.apply("none", untouched) == {} and untouched == {"XLA_FLAGS": "--a=1"}
    monkeypatch.setattr(gpu_profile, "nvidia_gpu_in_use", lambda: False)
    assert gpu_profile.apply("auto", untouched) == {} and untouched == {"XLA_FLAGS": "--a=1"}


def test_every_gpu_profile_flag_is_known_to_this_xla():
    """XLA aborts at start-up on a flag it does not know; its flag table is the same on every backend."""
    flags = " ".join(f"--{name}={value}" for name, value in gpu_profile.FLAGS.items())
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

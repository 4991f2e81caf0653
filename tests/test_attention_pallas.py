"""The fused attention kernels, Pallas (NVIDIA, jaxpar.parallel.attention_pallas) and splash (TPU,
jaxpar.parallel.attention_splash), held in Pallas' interpreter on CPU to the textbook masked softmax
(tests/reference.masked_attention, sharing no code with jaxpar), and the choice of kernel per call
(jaxpar.parallel.attention_kernels) on faked device kinds.

Both kernels run the same option sets on 130 tokens (a multiple of neither kernel's blocks): Pallas in blocks of
16 queries x 32 keys, splash in its smallest, 128, so that documents cross block boundaries and the tail is padded.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import copy_state, gradients, max_relative_error, reference_state
from reference import llama_loss, masked_attention as reference
from jaxpar.core import usage
from jaxpar.core.plan import Plan
from jaxpar.models.llama import LlamaConfig
from jaxpar.parallel import attention, attention_kernels, documents
from jaxpar.parallel.attention_flash import Blocks
from jaxpar.parallel.attention_math import Scoring
from jaxpar.parallel.attention_pallas import pallas_attention, pallas_refusal
from jaxpar.parallel.attention_splash import splash_attention, splash_refusal

TOLERANCE = 2e-6  # fp32, relative (norm-wise per leaf)
SEQ = 130
KERNELS = {"pallas": (pallas_attention, Blocks(16, 32)), "splash": (splash_attention, Blocks(128, 128))}


def documents_crossing_blocks(batch: int, seq: int) -> np.ndarray:
    """Segment ids with documents of 1 to 60 tokens and padding (segment 0) at each row's end; one document of
    each row spans tokens 110 to 135 at least (across splash's block boundary at 128)."""
    rng = np.random.default_rng(5)
    ids = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - 6), size=6, replace=False))
        cuts = np.unique(np.concatenate([cuts[(cuts < 110) | (cuts > 135)], [110]]))
        for doc, (start, stop) in enumerate(zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [seq - 1]]))):
            ids[row, start:stop] = doc + 1
    assert np.all(ids[:, 127] == ids[:, 128]) and np.all(ids[:, 128] > 0)
    return ids


def inputs(batch=1, heads=4, kv_heads=2, head_dim=64, value_dim=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, SEQ, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, SEQ, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, SEQ, kv_heads, value_dim or head_dim))
    return q, k, v, jax.random.normal(keys[3], (batch, SEQ, heads, value_dim or head_dim))


def value_and_grads(attend, q, k, v, weights):
    def run(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(weights)

    return jax.device_get(jax.jit(run)(q, k, v))


CASES = {  # name: (shape of the inputs, options, packed documents)
    "gqa-4-to-1-documents": ({"heads": 4, "kv_heads": 1, "batch": 2}, {}, True),
    "window-softcap-scale": ({}, {"window": 37, "softcap": 2.0, "scale": 0.3}, False),
    "documents-window-softcap": ({}, {"window": 21, "softcap": 3.0}, True),
    "head-dim-128-value-dim-256": ({"head_dim": 128, "value_dim": 256, "heads": 2, "kv_heads": 1}, {"window": 50},
                                   False),
    "head-dim-256": ({"head_dim": 256, "heads": 2, "kv_heads": 2}, {}, True),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_the_masked_softmax(kernel, name):
    """Values and gradients within 2e-6 (fp32) in Pallas' interpreter; padding rows get output and gradient 0."""
    shape, options, packed = CASES[name]
    q, k, v, weights = inputs(**shape)
    segments = jnp.asarray(documents_crossing_blocks(q.shape[0], SEQ)) if packed else None
    run, blocks = KERNELS[kernel]

    def fused(q, k, v):
        return run(q, k, v, Scoring(**options), segments, blocks, interpret=True)

    got = value_and_grads(fused, q, k, v, weights)
    want = value_and_grads(functools.partial(reference, segments=segments, **options), q, k, v, weights)
    value_error, grad_error = max_relative_error(got[0], want[0]), max_relative_error(got[1], want[1])
    assert value_error <= TOLERANCE and grad_error <= TOLERANCE, (value_error, grad_error)
    if packed:
        padding = np.asarray(segments) == 0
        assert not np.any(got[0][padding]) and not np.any(got[1][0][padding])


# -- through causal_attention: a forced kernel runs in the interpreter, or is refused off its device ------------------

@pytest.mark.parametrize("kernel", KERNELS)
def test_forced_kernel_through_causal_attention(kernel):
    """attention=pallas|splash on CPU is refused (naming the device and the interpreter) unless interpreted();
    there it runs with the plan's blocks, packed documents from the trace, GQA, a window and a soft cap."""
    q, k, v, weights = inputs(heads=4, kv_heads=2)
    segments = documents_crossing_blocks(1, SEQ)
    options = {"window": 29, "softcap": 4.0}
    blocks = {"pallas": "32,16", "splash": "128,128"}[kernel]
    plan = Plan.create("data=1", devices=jax.devices()[:1], attention=kernel, attention_blocks=blocks)

    def attend(q, k, v):
        with documents.scope({"segment_ids": jnp.asarray(segments)}):
            return attention.causal_attention(q, k, v, **options)

    with plan.activate():
        with pytest.raises(ValueError, match=f"attention='{kernel}' cannot run this attention: the device is cpu.*"
                                             r"interpreted\(\)"):
            attend(q, k, v)
        with attention_kernels.interpreted(), usage.recording() as used:
            got = value_and_grads(attend, q, k, v, weights)
    assert attention_kernels.choices(used) == [f"{kernel} (asked for (attention={kernel}), in Pallas' interpreter)"]
    want = value_and_grads(functools.partial(reference, segments=jnp.asarray(segments), **options), q, k, v, weights)
    assert max_relative_error(got[0], want[0]) <= TOLERANCE and max_relative_error(got[1], want[1]) <= TOLERANCE


# -- which kernel each call gets ---------------------------------------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"
TPU = "TPU v5p"


def call(**changes):
    fields = {"dtype": jnp.bfloat16, "head_dim": 128, "value_dim": 128, "segments": False, "scoring": Scoring(),
              "context_ways": 1, **changes}
    return attention_kernels.Call(**fields)


@pytest.mark.parametrize("changes, kernel, why", [
    ({}, "cudnn", "NVIDIA GPU"),
    ({"scoring": Scoring(window=4096)}, "cudnn", "sliding-window"),
    ({"segments": True}, "flash", "segment ids"),
    ({"scoring": Scoring(softcap=50.0)}, "flash", "soft cap"),
    ({"segments": True, "scoring": Scoring(softcap=50.0, window=512)}, "flash", "segment ids"),
    ({"dtype": jnp.float32}, "flash", "float32"),
])
def test_auto_on_nvidia_is_cudnn_else_flash_until_the_pallas_kernel_has_run_on_a_gpu(changes, kernel, why):
    """Segment ids or a soft cap never reach cuDNN; the Pallas kernel only when asked for (interpreter-tested only)."""
    name, reason = attention_kernels.choose(call(**changes), device_kind=H100)
    assert (name, why in reason) == (kernel, True), reason
    if name == "flash":
        assert "attention=pallas" in reason
        assert pallas_refusal(call(**changes), H100) is None  # the kernel would take it if asked


@pytest.mark.parametrize("changes, kernel, why", [
    ({"segments": True, "scoring": Scoring(softcap=50.0, window=512)}, "splash", "TPU"),
    ({"dtype": jnp.float32, "head_dim": 64, "value_dim": 64}, "splash", "TPU"),
    ({"dtype": jnp.float16}, "flash", "dtype float16"),
    ({"head_dim": 96, "value_dim": 96}, "flash", "head dimension 96"),
    ({"context_ways": 4}, "flash", "context parallelism"),
])
def test_auto_on_tpu_splash_then_flash(changes, kernel, why):
    name, reason = attention_kernels.choose(call(**changes), device_kind=TPU)
    assert (name, why in reason) == (kernel, True), reason


def test_auto_on_cpu_is_flash_even_in_the_interpreter():
    with attention_kernels.interpreted():
        name, reason = attention_kernels.choose(call(segments=True), device_kind="cpu")
    assert name == "flash" and "no fused kernel on cpu" in reason


def test_refusals_name_the_reason():
    assert "Triton, for NVIDIA GPUs" in pallas_refusal(call(), TPU)
    assert pallas_refusal(call(), "cpu", interpret=True) is None
    assert "query block 24" in pallas_refusal(call(), H100, Blocks(24, 32))
    assert "value head dimension 48" in pallas_refusal(call(value_dim=48), H100)
    assert "dtype int8" in pallas_refusal(call(dtype=jnp.int8), H100)
    assert "splash attention is a TPU kernel" in splash_refusal(call(), H100)
    assert "key block 64: splash attention's blocks are multiples of 128" in splash_refusal(call(), TPU,
                                                                                           Blocks(128, 64))
    with Plan.create("data=1", devices=jax.devices()[:1], attention="splash").activate():
        with pytest.raises(ValueError, match="attention='splash' cannot run this attention: the device is NVIDIA"):
            attention_kernels.choose(call(), device_kind=H100)


@pytest.mark.parametrize("kernel, blocks, why", [("splash", "64", "multiples of 128"),
                                                 ("pallas", "48,32", "powers of two >= 16")])
def test_bad_kernel_blocks_are_refused_by_the_plan(kernel, blocks, why):
    with pytest.raises(ValueError, match=f"attention_blocks='{blocks}' with attention='{kernel}': .*{why}"):
        Plan.create("data=1", devices=jax.devices()[:1], attention=kernel, attention_blocks=blocks)


# A data rank's 2 of the 4 rows and a tensor rank's 2 of the 4 query heads: Pallas [rows, seq (its blocks shrunk to
# it), heads, head_dim]; splash [rows, heads, seq (to its 128-blocks), head_dim].
SHARD = {"pallas": (2, 32, 2, 64), "splash": (2, 2, 128, 64)}
MODEL = LlamaConfig(vocab=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=64, seq_len=32)


@pytest.mark.parametrize("kernel", KERNELS)
def test_training_gradients_under_zero3_data_and_tensor(kernel):
    """The step's loss and gradients under data=2,tensor=2 with ZeRO-3 (the step manual over data, a remat policy
    saving matmuls) equal plain JAX's: the kernel runs on one data rank's rows and one tensor rank's heads (XLA's
    partitioner would gather a Pallas call's operands whole)."""
    model, state, _ = reference_state(MODEL)
    params = copy_state(state.params)
    tokens = jax.random.randint(jax.random.key(1), (4, MODEL.seq_len + 1), 0, MODEL.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    want_loss, want_grads = jax.device_get(jax.jit(jax.value_and_grad(lambda p, b: llama_loss(p, b, MODEL)[0]))(
        params, batch))
    plan = Plan.create("data=2,tensor=2", devices=jax.devices()[:4], zero=3, attention=kernel)
    with attention_kernels.interpreted():
        loss, grads = gradients(model, params, batch, plan)
        with plan.activate():
            jaxpr = jax.make_jaxpr(lambda q: attention.causal_attention(q, q[:, :, :2], q[:, :, :2]))(
                jnp.zeros((4, 32, 4, 64)))
    shapes = [next(v.aval.shape for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating))  # q
              for eqn in all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"]
    assert set(shapes) == {SHARD[kernel]}, shapes
    assert abs(float(loss) / float(want_loss) - 1) <= 1e-5
    assert max_relative_error(grads, want_grads) <= 1e-5


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)

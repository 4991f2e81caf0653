"""weight_einsum: jnp.einsum's values and gradients, and weight gradients XLA:CPU runs in its fused matmul kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.matmul import weight_einsum
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.moe import CONFIGS as MOE_CONFIGS, MoeLlama
from jaxpar.core.plan import Plan
from jaxpar.train.state import abstract_state, describe
from jaxpar.train.step import make_train_step

EQUATIONS = {  # equation: (x shape, w shape), the layers' own einsums
    "bsd,df->bsf": ((2, 8, 16), (16, 32)),
    "bsf,fd->bsd": ((2, 8, 32), (32, 16)),
    "bsd,dhk->bshk": ((2, 8, 16), (16, 4, 8)),
    "bshk,hkd->bsd": ((2, 8, 4, 8), (4, 8, 16)),
    "gecd,edf->gecf": ((2, 3, 4, 16), (3, 16, 8)),  # an expert axis in both operands and the output
    "gecf,efd->gecd": ((2, 3, 4, 8), (3, 8, 16)),
    "bsd,dv->bsv": ((1, 8, 32), (32, 16384)),  # an output layer over 1 MiB, fed few tokens
}


def _small_integers(key, shape):
    """fp32 arrays of integers in [-4, 4]: every product and sum below is exact, in whatever order XLA adds."""
    return jax.random.randint(key, shape, -4, 5).astype(jnp.float32)


@pytest.mark.parametrize("equation", EQUATIONS)
def test_values_and_gradients_are_einsums(equation):
    """Bit for bit: on exactly representable sums any summation order (a batched product's pinned layout sums in
    another than the einsum's) gives the same values, so a wrong contraction or transpose cannot hide in rounding."""
    x_shape, w_shape = EQUATIONS[equation]
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x, w = _small_integers(kx, x_shape), _small_integers(kw, w_shape)
    ours, ours_vjp = jax.vjp(lambda a, b: weight_einsum(equation, a, b), x, w)
    ref, ref_vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b), x, w)
    cotangent = _small_integers(kc, ref.shape)
    np.testing.assert_array_equal(ours, ref)
    for got, want in zip(ours_vjp(cotangent), ref_vjp(cotangent)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("equation", ["bsd,dv->bsv", "gecd,edf->gecf"])
def test_a_wider_out_dtype_gives_the_widened_products_values_and_gradients(equation):
    """bf16 operands, fp32 out: the values and gradients of `jnp.einsum(...).astype(float32)`, bit for bit on
    exactly representable sums (the gradients take the cotangent rounded to bf16, as the widening's transpose does)."""
    x_shape, w_shape = EQUATIONS[equation]
    kx, kw, kc = jax.random.split(jax.random.key(3), 3)
    x, w = (_small_integers(k, shape).astype(jnp.bfloat16) for k, shape in ((kx, x_shape), (kw, w_shape)))
    ours, ours_vjp = jax.vjp(lambda a, b: weight_einsum(equation, a, b, out_dtype=jnp.float32), x, w)
    ref, ref_vjp = jax.vjp(lambda a, b: jnp.einsum(equation, a, b).astype(jnp.float32), x, w)
    assert ours.dtype == ref.dtype == jnp.float32
    np.testing.assert_array_equal(ours, ref)
    cotangent = _small_integers(kc, ref.shape)
    for got, want in zip(ours_vjp(cotangent), ref_vjp(cotangent)):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_fp32_logits_of_bf16_operands_are_written_by_the_fused_matmul():
    """Issue 16: an output layer's logits were made in bf16 and widened to fp32 afterwards: XLA:CPU ran that as a
    pass of its own over [tokens, vocab] after the matmul (jax 0.12: a bf16 product, then a convert; jax 0.10: the
    operands widened, an fp32 product, then a rounding pass). With `out_dtype` the fused bf16 matmul writes the
    fp32 logits itself, and nothing else runs over them before the softmax's reductions."""
    x, w = jnp.ones((1, 8, 32), jnp.bfloat16), jnp.ones((32, 4096), jnp.bfloat16)

    def logits_passes(logits):
        """The ops over [tokens, vocab] outside the fused matmuls and reductions, and the fused ones."""
        text = jax.jit(lambda x, w: jax.nn.logsumexp(logits(x, w), axis=-1)).lower(x, w).compile().as_text()
        ops = re.findall(r"= (\w+)\[(?:1,)?8,4096\]\S* fusion\(.*kind=(\w+)", text)
        return [op for op in ops if op[1] != "kCustom"], [op for op in ops if op[1] == "kCustom"], text

    narrow_passes, _, _ = logits_passes(lambda x, w: weight_einsum("bsd,dv->bsv", x, w).astype(jnp.float32))
    wide_passes, wide_matmuls, text = logits_passes(lambda x, w: weight_einsum("bsd,dv->bsv", x, w, out_dtype=jnp.float32))
    assert narrow_passes and not wide_passes
    assert wide_matmuls == [("f32", "kCustom")] and _plain_dots(text) == []


def test_a_replicated_weight_in_a_shard_map_gets_its_gradient_summed_over_the_batch():
    """The weight is not varying over data, the batch is: its gradient is the sum over the ranks, as autodiff's."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jax.random.normal(jax.random.key(1), (16, 4, 16)), jax.random.normal(jax.random.key(2), (16, 32))

    def grads(einsum):
        def local(x, w):
            return jax.grad(lambda w: jnp.sum(einsum("bsd,df->bsf", x, w) ** 2))(w)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))(x, w)

    np.testing.assert_allclose(grads(weight_einsum), grads(jnp.einsum), rtol=1e-5)


def _weight_gradient_hlo(tokens: int, d: int, vocab: int) -> str:
    x, w = jnp.ones((1, tokens, d)), jnp.ones((d, vocab))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(weight_einsum("bsd,dv->bsv", x, w) ** 2)))
    return grad.lower(w, x).compile().as_text()


def test_an_output_layers_weight_gradient_moves_the_activations_when_the_tokens_are_few():
    """Fewer tokens than input features (a pipeline's microbatch at an output layer): x is copied into [features,
    tokens] and the dot writes the gradient in w's order; no vocabulary-first array is made."""
    hlo = _weight_gradient_hlo(tokens=8, d=16, vocab=512)
    assert "f32[16,512]" in hlo and "f32[512,16]" not in hlo


def test_an_output_layers_weight_gradient_is_made_vocabulary_first_when_the_tokens_are_many():
    """As many tokens as input features: the cotangent would be as large as the weight as the copied form's right
    operand, so the gradient is made as [vocabulary, features] and transposed into w's order (`matmul._copies_x`).
    Before, x was copied wherever it alone was smaller than the weight."""
    hlo = _weight_gradient_hlo(tokens=16, d=16, vocab=512)
    assert "f32[512,16]" in hlo


def test_an_output_layers_input_gradient_keeps_the_vocabulary_out_of_the_right_operand():
    """A weight over 1 MiB, fed fewer tokens than its input features: the input gradient is one dot with the weight
    on the left, written as [features, tokens] (an x-sized array), then moved into x's order. Before, it was
    `cotangent @ w^T`, the whole weight the dot's right operand."""
    x, w = jnp.ones((2, 8, 64)), jnp.ones((64, 8192))
    dx = jax.jit(jax.grad(lambda x, w: jnp.sum(weight_einsum("bsd,dv->bsv", x, w) ** 2)))
    hlo = dx.lower(x, w).compile().as_text()
    products = re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} fusion\(.*kind=kCustom", hlo)
    assert ("64", "16") in products and ("16", "64") not in products, products


def _plain_dots(hlo: str) -> list[str]:
    """Dot instructions outside fused computations: those XLA:CPU does not run in its fused matmul kernels."""
    computations = re.split(r"\n(?=\S)", hlo)
    return [line.strip() for c in computations if not c.startswith(("%fused_computation", "fused_computation"))
            for line in c.splitlines() if " dot(" in line]


LLAMA = LlamaConfig(vocab=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=256, seq_len=16,
                    tie_embeddings=False)


@pytest.mark.parametrize("mesh, name", [("data=8", "llama"), ("data=2,tensor=4", "llama"),
                                        ("data=4,pipe=2", "llama"), ("data=4,expert=2", "moe-tiny")])
def test_every_matmul_of_the_step_runs_fused_on_cpu(mesh, name):
    """Issue 16: differentiated as plain einsums, the MLP's and the output layer's weight gradients were dots with
    a left operand contracted along its leading dimension, run outside XLA:CPU's fused kernels; on moe-tiny the
    experts' batched dots, forward and backward, the router's weight gradient and the combine's weighted sum
    were 8 such dots at data=4,expert=2."""
    config = LLAMA if name == "llama" else MOE_CONFIGS[name]
    plan = Plan.create(mesh, precision="bf16", **({"microbatches": 2} if "pipe" in mesh else {}))
    optimizer = optax.adamw(1e-3)
    model = describe(lambda: (Llama if name == "llama" else MoeLlama)(config, nnx.Rngs(0)))
    batch = {k: jax.ShapeDtypeStruct((16, config.seq_len), jnp.int32, sharding=plan.sharding(plan.batch_spec(2)))
             for k in ("inputs", "targets")}
    compiled = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(
        abstract_state(model, optimizer, plan), batch).compile()
    assert _plain_dots(compiled.as_text()) == []

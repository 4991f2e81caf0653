"""Frozen weights in int8 and NF4 (jaxpar.parallel.quantize): the paper's levels, nearest codes, exact dequantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.parallel import quantize
from jaxpar.parallel.quantize import NF4


def test_nf4_levels_are_the_papers_normal_quantiles():
    built = quantize.normal_float_levels()
    print(f"NF4 from N(0,1) quantiles vs the published table: max difference {np.abs(built - NF4).max():.1e}")
    np.testing.assert_allclose(built, NF4, rtol=0, atol=2e-7)
    assert NF4.size == 16 and NF4[0] == -1.0 and NF4[-1] == 1.0 and NF4[7] == 0.0
    assert (NF4[8:] > 0).all() and (NF4[:7] < 0).all() and np.all(np.diff(NF4) > 0)


def test_nf4_codes_are_the_nearest_level_and_dequantize_to_level_times_absmax():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 5, 128)).astype(np.float32) * rng.uniform(0.01, 3, size=(3, 5, 1)).astype(np.float32)
    q = quantize.quantize(jnp.asarray(w), "nf4")
    assert q.codes.shape == (3, 5, 64) and q.codes.dtype == jnp.uint8 and q.scales.shape == (3, 5, 2)
    blocks = w.reshape(3, 5, 2, 64)
    absmax = np.abs(blocks).max(axis=-1)
    np.testing.assert_array_equal(np.asarray(q.scales), absmax)
    nearest = np.abs((blocks / absmax[..., None])[..., None] - NF4).argmin(axis=-1)  # brute force over 16 levels
    codes = np.asarray(quantize._unpack(q.codes)).reshape(3, 5, 2, 64)
    np.testing.assert_array_equal(codes, nearest)
    want = (NF4[nearest] * absmax[..., None]).reshape(w.shape)
    np.testing.assert_array_equal(np.asarray(quantize.dequantize(q)), want)
    # each block's largest magnitude lands exactly on +-1 and comes back exactly
    back = np.asarray(quantize.dequantize(q)).reshape(3, 5, 2, 64)
    at = np.abs(blocks).argmax(axis=-1)[..., None]
    np.testing.assert_array_equal(np.take_along_axis(back, at, -1), np.take_along_axis(blocks, at, -1))


def test_every_byte_unpacks_to_its_two_codes_and_packs_back():
    codes = jnp.asarray(np.stack(np.divmod(np.arange(256), 16), axis=-1).reshape(-1), jnp.uint8)  # (hi, lo) pairs
    packed = quantize._pack(codes)
    np.testing.assert_array_equal(np.asarray(packed), np.arange(256))
    np.testing.assert_array_equal(np.asarray(quantize._unpack(packed)), np.asarray(codes))


def test_int8_rounds_to_the_nearest_of_255_steps_of_absmax():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 192)).astype(np.float32)
    q = quantize.quantize(jnp.asarray(w), "int8")
    assert q.codes.dtype == jnp.int8 and q.scales.shape == (4, 3)
    step = np.repeat(np.asarray(q.scales) / 127, 64, axis=-1)
    error = np.abs(np.asarray(quantize.dequantize(q)) - w)
    assert (error <= step / 2 * (1 + 1e-6)).all()
    np.testing.assert_array_equal(np.asarray(q.codes), np.round(w / step).astype(np.int8))


def test_dequantize_gives_the_compute_dtype_and_zero_blocks_stay_zero():
    w = jnp.zeros((2, 64)).at[1, 3].set(-2.5)
    for kind in quantize.KINDS:
        q = quantize.quantize(w, kind)
        out = quantize.dequantize(q, jnp.bfloat16)
        assert out.dtype == jnp.bfloat16 and out.shape == (2, 64)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(w))


def test_quantized_weights_are_pytrees_that_jit_and_slice_per_layer():
    w = jax.random.normal(jax.random.key(0), (3, 16, 64))  # [layers, in, out]: a scan hands one layer at a time
    q = jax.jit(lambda w: quantize.quantize(w, "nf4"))(w)
    assert q.shape == (3, 16, 64)
    per_layer = jax.lax.map(lambda layer: quantize.dequantize(layer), q)
    np.testing.assert_array_equal(np.asarray(per_layer), np.asarray(quantize.dequantize(q)))


def test_nf4_takes_under_three_tenths_of_bf16s_bytes():
    q = quantize.quantize(jnp.ones((256, 1024)), "nf4")
    assert q.nbytes == 256 * 1024 * quantize.bytes_per_value("nf4")
    ratio = quantize.bytes_per_value("nf4") / 2
    print(f"bytes per value: nf4 {quantize.bytes_per_value('nf4')}, int8 {quantize.bytes_per_value('int8')}; "
          f"nf4 / bf16 = {ratio:.3f}")
    assert ratio <= 0.3


@pytest.mark.parametrize("shape, kind, message", [
    ((16, 48), "nf4", r"nf4 quantization cuts the weight's last dimension into blocks of 64 values, but the weight "
                      r"has shape \[16, 48\]: 48 is not a multiple of 64"),
    ((16, 64), "int4", r"quantized base dtype must be one of int8, nf4, got 'int4'"),
])
def test_bad_shapes_and_kinds_are_refused_in_one_line(shape, kind, message):
    with pytest.raises(ValueError, match=message):
        quantize.quantize(jnp.ones(shape), kind)

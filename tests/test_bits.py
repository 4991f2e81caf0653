"""jaxpar.parallel.bits: 16-bit floats moved as their bits give jax.lax's values and gradients, and stay 16-bit when compiled."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.parallel import bits
MESH = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
RING = [(i, (i + 1) % 8) for i in range(8)]

# name: (jaxpar.parallel.bits' form, jax.lax's, global input shape, the collective's HLO name)
COLLECTIVES = {
    "all_gather": (lambda x: bits.all_gather(x, "data", axis=1),
                   lambda x: jax.lax.all_gather(x, "data", axis=1, tiled=True), (16, 24), "all-gather"),
    "psum_scatter": (lambda x: bits.psum_scatter(x, "data", scatter_dimension=1),
                     lambda x: jax.lax.psum_scatter(x, "data", scatter_dimension=1, tiled=True), (16, 64), None),
    "ppermute": (lambda x: bits.ppermute(x, "data", RING),
                 lambda x: jax.lax.ppermute(x, "data", RING), (16, 24), "collective-permute"),
    "all_to_all": (lambda x: bits.all_to_all(x, "data", split_axis=1, concat_axis=0),
                   lambda x: jax.lax.all_to_all(x, "data", 1, 0, tiled=True), (64, 16), "all-to-all"),
}


def _step(collective):
    """Per device: the collective, then a loss that weighs every element differently, and its gradient."""
    def loss(x):
        y = collective(x).astype(jnp.float32)
        weights = jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) % 7 - 3
        return jnp.sum(y * weights), y

    def per_device(x):
        (_, y), grad = jax.value_and_grad(loss, has_aux=True)(x)
        return y, grad

    return jax.jit(jax.shard_map(per_device, mesh=MESH, in_specs=P("data"), out_specs=(P("data"), P("data"))))


def _input(shape, dtype):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    return jax.device_put(x, jax.NamedSharding(MESH, P("data")))


@pytest.mark.parametrize("name", COLLECTIVES)
def test_bf16_values_and_gradients_match_jax_lax_bit_for_bit(name):
    ours, theirs, shape, _ = COLLECTIVES[name]
    x = _input(shape, jnp.bfloat16)
    for got, want in zip(_step(ours)(x), _step(theirs)(x)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("name", [n for n, c in COLLECTIVES.items() if c[3]])
def test_bf16_collectives_compile_to_16_bit_ones_on_cpu(name):
    """jax.lax's bf16 collective compiles to an f32 one on XLA:CPU; jaxpar.parallel.bits' to a u16 one of the same shape.

    The gradient's collective of a data movement is itself in bits; a gather's gradient is a (float) reduce-scatter.
    """
    ours, theirs, shape, hlo_name = COLLECTIVES[name]
    x = _input(shape, jnp.bfloat16)

    def types(step):
        """Element types of every result of the collective, a tuple's included (XLA:CPU splits an all-to-all)."""
        text = step.lower(x).compile().as_text()
        results = re.findall(rf"= (\S+|\(.*?\)) {hlo_name}(?:-start)?\(", text)
        return [t for r in results for t in re.findall(r"(\w+)\[", r)]

    assert types(_step(theirs)) and set(types(_step(theirs))) == {"f32"}
    assert types(_step(ours)) and set(types(_step(ours))) == {"u16"}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_fp32_arrays_take_jax_lax_collective_unchanged(name):
    ours, theirs, shape, _ = COLLECTIVES[name]
    x = _input(shape, jnp.float32)
    assert _step(ours).lower(x).as_text() == _step(theirs).lower(x).as_text()


def test_a_tree_moves_its_16_bit_leaves_as_bits_and_the_rest_as_they_are():
    """ppermute of (bf16, fp32, int32), as the ring attention sends its K/V blocks: each leaf keeps its dtype."""
    tree = (_input((16, 8), jnp.bfloat16), _input((16, 8), jnp.float32),
            jax.device_put(jnp.arange(128, dtype=jnp.int32).reshape(16, 8), jax.NamedSharding(MESH, P("data"))))
    send = lambda f: jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=P("data")))
    got = send(lambda t: bits.ppermute(t, "data", RING))(tree)
    want = send(lambda t: jax.lax.ppermute(t, "data", RING))(tree)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

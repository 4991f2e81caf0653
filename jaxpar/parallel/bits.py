"""Collectives that only move data carry 16-bit floats as their bits.

XLA's CPU compiler widens a bf16 or f16 all-gather, collective-permute or
all-to-all to f32 before it runs (read from the compiled HLO: ZeRO-3's gather
of the output layer's bf16 weights, 16 MB, runs as a 32 MB f32 one), which
doubles the bytes each moves. Moved as uint16 bits instead, the same values
arrive exactly and at their own width. Each stays differentiable: the
backward of a gather is the reduce-scatter of its cotangent (arithmetic, so
left to the compiler in the float type) and that of a reduce-scatter a gather
in bits; the backward of a permutation or an all-to-all is the inverse one,
itself moved as bits. Other backends move 16-bit floats natively; there
these are the plain `jax.lax` collectives.

Each function takes one array or a tree of them, as its `jax.lax` namesake does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.core import device_facts

_SIXTEEN_BIT_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _sixteen_bit(x) -> bool:
    return jnp.dtype(x.dtype) in _SIXTEEN_BIT_FLOATS


def _widened(tree) -> bool:
    """Whether the backend would widen a collective that moves `tree` (a 16-bit float in it, on the plan's CPU devices)."""
    return device_facts.current().backend == "cpu" and any(_sixteen_bit(x) for x in jax.tree.leaves(tree))


def _as_bits(move, tree):
    """`move(tree)` run on the bits of its 16-bit floats: the same values, moved at their own width."""
    to_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16) if _sixteen_bit(x) else x
    moved = move(jax.tree.map(to_bits, tree))
    return jax.tree.map(lambda y, x: jax.lax.bitcast_convert_type(y, x.dtype) if _sixteen_bit(x) else y, moved, tree)


def all_gather(x, axes, *, axis: int):
    """`jax.lax.all_gather(x, axes, axis=axis, tiled=True)`; its backward is the reduce-scatter of the cotangent."""
    return _gather(x, axes, axis) if _widened(x) else jax.lax.all_gather(x, axes, axis=axis, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x, axes, axis):
    return _as_bits(lambda bits: jax.lax.all_gather(bits, axes, axis=axis, tiled=True), x)


def _gather_forward(x, axes, axis):
    return _gather(x, axes, axis), None


def _gather_backward(axes, axis, _, cotangent):
    return (jax.lax.psum_scatter(cotangent, axes, scatter_dimension=axis, tiled=True),)


_gather.defvjp(_gather_forward, _gather_backward)


def psum_scatter(x, axes, *, scatter_dimension: int):
    """`jax.lax.psum_scatter(..., tiled=True)` (a float sum, left to the compiler); its backward gathers the cotangent."""
    if not _widened(x):
        return jax.lax.psum_scatter(x, axes, scatter_dimension=scatter_dimension, tiled=True)
    return _scatter(x, axes, scatter_dimension)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scatter(x, axes, dim):
    return jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)


def _scatter_forward(x, axes, dim):
    return _scatter(x, axes, dim), None


def _scatter_backward(axes, dim, _, cotangent):
    return (_gather(cotangent, axes, dim),)


_scatter.defvjp(_scatter_forward, _scatter_backward)


def ppermute(x, axis_name, perm):
    """`jax.lax.ppermute(x, axis_name, perm)`; its backward sends the cotangent along the inverse permutation."""
    perm = tuple((int(source), int(dest)) for source, dest in perm)
    return _permute(x, axis_name, perm) if _widened(x) else jax.lax.ppermute(x, axis_name, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _permute(x, axis_name, perm):
    return _as_bits(lambda bits: jax.lax.ppermute(bits, axis_name, perm), x)


def _permute_forward(x, axis_name, perm):
    return _permute(x, axis_name, perm), None


def _permute_backward(axis_name, perm, _, cotangent):
    return (_permute(cotangent, axis_name, tuple((dest, source) for source, dest in perm)),)


_permute.defvjp(_permute_forward, _permute_backward)


def all_to_all(x, axis_name, split_axis: int, concat_axis: int):
    """`jax.lax.all_to_all(..., tiled=True)`; its backward is the all-to-all back (split and concat swapped)."""
    if not _widened(x):
        return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)
    return _exchange(x, axis_name, split_axis, concat_axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _exchange(x, axis_name, split_axis, concat_axis):
    return _as_bits(lambda bits: jax.lax.all_to_all(bits, axis_name, split_axis, concat_axis, tiled=True), x)


def _exchange_forward(x, axis_name, split_axis, concat_axis):
    return _exchange(x, axis_name, split_axis, concat_axis), None


def _exchange_backward(axis_name, split_axis, concat_axis, _, cotangent):
    return (_exchange(cotangent, axis_name, concat_axis, split_axis),)


_exchange.defvjp(_exchange_forward, _exchange_backward)

"""A layer's weight einsum, with a weight gradient XLA:CPU runs in its fast matmul kernels.

The weight gradient of `x @ w` contracts the token dimensions that lead both
x and the output's cotangent. Differentiated as written, XLA folds the
transpose that puts it in w's order into the dot itself, leaving a dot whose
left operand is contracted along its leading dimension: XLA:CPU does not
hand such a dot to its fused (YNNPACK) matmul kernels and runs it on a generic
path, 2.6x slower for an output layer's weight gradient at vocab 4096 (measured,
benchmarks/vs_maxtext.md). GSPMD escapes it by accident when it places the
gradient's all-reduce between the dot and the transpose; inside the step's
shard_map over data nothing separates them. Here the gradient is computed with
w's features first, kept that way by an optimization barrier, and only then
transposed into w's order: one copy of a weight-sized array.

Only the CPU backend takes this path; GPU matmul libraries read transposed
operands directly, so there `weight_einsum` is `jnp.einsum`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.rules import varying_axes


def weight_einsum(equation: str, x, w):
    """jnp.einsum(equation, x, w) for an activation x and a weight w; the same values and gradients."""
    if jax.default_backend() != "cpu":
        return jnp.einsum(equation, x, w)
    return _einsum(equation.replace(" ", ""), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum(equation, x, w):
    return jnp.einsum(equation, x, w)


def _forward(equation, x, w):
    return jnp.einsum(equation, x, w), (x, w)


def _backward(equation, saved, cotangent):
    x, w = saved
    inputs, out = equation.split("->")
    x_letters, w_letters = inputs.split(",")
    _, input_gradient = jax.vjp(lambda a: jnp.einsum(equation, a, w), x)
    (dx,) = input_gradient(cotangent)
    # w's letters with its output features first: the cotangent is the dot's left operand, contracted last.
    order = sorted(w_letters, key=lambda letter: (letter not in out, w_letters.index(letter)))
    grad = jnp.einsum(f"{out},{x_letters}->{''.join(order)}", cotangent, x)
    grad = jnp.transpose(jax.lax.optimization_barrier(grad), [order.index(letter) for letter in w_letters])
    return _like(dx, x), _like(grad.astype(w.dtype), w)


def _like(gradient, primal):
    """The gradient summed over the manual axes it varies along but its primal does not (as autodiff would)."""
    extra = tuple(sorted(varying_axes(gradient) - varying_axes(primal)))
    return jax.lax.psum(gradient, extra) if extra else gradient


_einsum.defvjp(_forward, _backward)

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

A batched weight einsum (a letter in x, w and the output: an MoE layer's
expert axis, `gecd,edf->gecf`) is not helped by that order: its tokens sit
between the batch and feature dimensions of both operands, and XLA:CPU runs
such a batched dot, forward or backward, on the generic path unless its
operands are laid out as [batch, rows, contracted] and [batch, contracted,
columns]. There every product (the forward and both gradients) is computed in
exactly that form, the operands and the result pinned by optimization
barriers so XLA cannot fold the transposes back into the dot: copies of
activation-sized arrays.

Only the CPU backend takes this path; GPU matmul libraries read transposed
operands directly, so there `weight_einsum` is `jnp.einsum`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.core import device_facts
from jaxpar.parallel.constrain import varying_axes


def weight_einsum(equation: str, x, w, *, out_dtype=None):
    """jnp.einsum(equation, x, w) for an activation x and a weight w; the same values and gradients (a batched
    product's fp32 sums may be added in another order).

    `out_dtype`: the product's dtype where it is wider than the operands' (an
    output layer's fp32 logits). XLA:CPU's fused matmul writes it at that
    width from its fp32 sums, where a product in the operands' dtype would be
    rounded to it and then widened in a pass of its own over the whole output;
    the gradients are those of the operands' product widened (the cotangent
    is rounded to the operands' dtype first).
    """
    if device_facts.current().backend != "cpu":  # the plan's devices (a GPU target's too)
        y = jnp.einsum(equation, x, w)
        return y if out_dtype is None else y.astype(out_dtype)
    return _einsum(equation.replace(" ", ""), None if out_dtype is None else jnp.dtype(out_dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(equation, out_dtype, x, w):
    return _product(equation, x, w, out_dtype)


def _forward(equation, out_dtype, x, w):
    return _product(equation, x, w, out_dtype), (x, w)


def _batch_letters(equation) -> list[str]:
    """The letters of a batched product (in both operands and the output); none where it is not one (see above)."""
    inputs, out = equation.split("->")
    a_letters, b_letters = inputs.split(",")
    if (set(a_letters) ^ set(b_letters)) - set(out):  # a letter summed within one operand: left to jnp.einsum
        return []
    return [c for c in out if c in a_letters and c in b_letters]


def _product(equation, a, b, out_dtype=None):
    """jnp.einsum(equation, a, b); a batched product as a [batch, rows, contracted] x [batch, contracted, columns] dot."""
    inputs, out = equation.split("->")
    a_letters, b_letters = inputs.split(",")
    batch = _batch_letters(equation)
    if not batch:
        return jnp.einsum(equation, a, b, preferred_element_type=out_dtype)
    contracted = [c for c in a_letters if c in b_letters and c not in out]
    rows = [c for c in out if c in a_letters and c not in batch]
    columns = [c for c in out if c in b_letters and c not in batch]
    size = dict(zip(a_letters, a.shape)) | dict(zip(b_letters, b.shape))

    def pinned(x, letters, groups):
        order = [letters.index(c) for group in groups for c in group]
        return jnp.transpose(x, order).reshape([math.prod(size[c] for c in group) for group in groups])

    a3, b3 = jax.lax.optimization_barrier((pinned(a, a_letters, (batch, rows, contracted)),
                                           pinned(b, b_letters, (batch, contracted, columns))))
    y = jax.lax.optimization_barrier(jnp.einsum("bmk,bkn->bmn", a3, b3, preferred_element_type=out_dtype))
    grouped = [*batch, *rows, *columns]
    y = y.reshape([size[c] for c in grouped])
    return jnp.transpose(y, [grouped.index(c) for c in out])


def _backward(equation, out_dtype, saved, cotangent):
    x, w = saved
    cotangent = cotangent.astype(jnp.result_type(x, w))
    inputs, out = equation.split("->")
    x_letters, w_letters = inputs.split(",")
    if _batch_letters(equation):
        dx = _product(f"{out},{w_letters}->{x_letters}", cotangent, w)
        grad = _product(f"{x_letters},{out}->{w_letters}", x, cotangent)
        return _like(dx.astype(x.dtype), x), _like(grad.astype(w.dtype), w)
    dx = _input_gradient(x_letters, w_letters, out, x, w, cotangent)
    return _like(dx, x), _like(_weight_gradient(x_letters, w_letters, out, x, w, cotangent).astype(w.dtype), w)


# Up to this size a weight as the input gradient's right operand ran no slower (measured: `_input_gradient`).
_LARGE_WEIGHT_BYTES = 1 << 20


def _input_gradient(x_letters: str, w_letters: str, out: str, x, w, cotangent):
    """The input gradient of einsum(x, w), with a large weight as the dot's left operand where it pays.

    XLA:CPU's fused matmul runs as if it repacked its right operand on every
    call, and the input gradient `cotangent @ w^T` makes the weight that
    operand: for an output layer over a vocabulary fed few tokens at a time
    (a pipeline's microbatch), that costs more than the product. Where the
    weight holds its output features last (contracted along its minor
    dimension) and is larger than the cotangent and than 1 MiB, the
    gradient is made as `w @ cotangent^T`, [input features, tokens], then
    moved into x's order: a copy of an x-sized array. Issue 16's head
    (256 x 32000), four 64-token microbatches on 8 host devices: 0.68x the
    time of the first form (benchmarks/output_layer.py); the layers' own
    weights (under 1 MiB) ran up to 1.27x slower that way, 256 tokens at a
    time 0.98x.
    """
    inputs = "".join(c for c in w_letters if c not in out)
    tokens = "".join(c for c in x_letters if c not in w_letters)
    features = "".join(c for c in w_letters if c in out)
    if (w_letters == inputs + features and set(x_letters) == set(inputs + tokens) and set(tokens) <= set(out)
            and cotangent.size < w.size and w.size * w.dtype.itemsize > _LARGE_WEIGHT_BYTES):
        features_first = jax.lax.optimization_barrier(jnp.einsum(f"{w_letters},{out}->{inputs}{tokens}", w, cotangent))
        return jnp.einsum(f"{inputs}{tokens}->{x_letters}", features_first).astype(x.dtype)
    _, input_gradient = jax.vjp(lambda a: jnp.einsum(f"{x_letters},{w_letters}->{out}", a, w), x)
    return input_gradient(cotangent)[0]


def _weight_gradient(x_letters: str, w_letters: str, out: str, x, w, cotangent):
    """The weight gradient of einsum(x, w) as a dot XLA:CPU runs in its fast kernels, with one copy: the cheaper.

    With w's output features first, the cotangent is the dot's left operand,
    contracted last, and the result is transposed into w's order: a copy of a
    weight-sized array. Where that copy is the larger cost (`_copies_x`), x is
    copied instead, into [input features, tokens], and the dot writes w's
    order directly, with the cotangent as its right operand.
    """
    order = "".join(sorted(w_letters, key=lambda letter: (letter not in out, w_letters.index(letter))))
    if order != w_letters and _copies_x(x, w, cotangent):
        inputs = "".join(c for c in x_letters if c in w_letters)
        tokens = "".join(c for c in x_letters if c not in w_letters)
        features_first = jax.lax.optimization_barrier(jnp.einsum(f"{x_letters}->{inputs}{tokens}", x))
        return jnp.einsum(f"{inputs}{tokens},{out}->{w_letters}", features_first, cotangent)
    grad = jnp.einsum(f"{out},{x_letters}->{order}", cotangent, x)
    return jnp.transpose(jax.lax.optimization_barrier(grad), [order.index(letter) for letter in w_letters])


def _copies_x(x, w, cotangent) -> bool:
    """Whether a weight gradient copies x rather than transposing a weight-sized result: where x and the cotangent
    are both smaller than the weight, i.e. the tokens are fewer than each of its feature counts.

    Measured on issue 16's step (benchmarks/in_step.py --change weight_gradient, 8
    host devices, both rules interleaved in one process; step time of this
    rule over copying x wherever x alone is smaller): with as many tokens per
    device as the layers' input features (256) the transposed form pays,
    fsdp8 0.934 and dp8 0.952 (the output layer's gradient dot 221 -> 80 ms
    per device-step in a profile: the copied form's right operand, the
    cotangent, is as large as the weight there, and XLA:CPU's fused matmul
    runs as if it repacked that operand per call); with 2-4 times as many
    tokens it neither pays nor costs (1.001, 1.012, 1.028, 1.057); the
    pipelines' 64-token microbatches keep copying x (every weight gradient
    transposed made pp2 x dp4's step 1.07-1.14x slower).
    """
    return x.size < w.size and cotangent.size < w.size


def _like(gradient, primal):
    """The gradient summed over the manual axes it varies along but its primal does not (as autodiff would)."""
    extra = tuple(sorted(varying_axes(gradient) - varying_axes(primal)))
    return jax.lax.psum(gradient, extra) if extra else gradient


_einsum.defvjp(_forward, _backward)

"""Stacked layers: one block's parameters stacked along a leading `layers` axis, run by `lax.scan`.

A transformer is mostly the same block many times. Stacking its parameters and
scanning over them compiles the block once, and gives jaxpar one place to apply
what a layer stack needs under a plan, with no change to the block itself:

- ZeRO-2/3: each layer's parameters are all-gathered inside the scan, just
  before the block runs; autodiff turns each gather into the reduce-scatter of
  that layer's gradients (jaxpar.parallel.zero);
- the plan's activation-checkpointing policy wraps each layer (`remat_wrapper`);
- auxiliary outputs (router losses, metrics) come back stacked per layer.

`scan_layers` is the functional form (a block function and a dict of stacked
arrays: the built-in Llama uses it); `Stack` is the NNX module that stacks a
user's own block. Under `pipe > 1` a model hands its stacked layers to the
pipeline (`jaxpar.pipeline.executor.loss`, or `jaxpar.pipelined_loss`
for a user's NNX model with a `Stack`), which cuts them into stages and runs
each stage through `scan_layers`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from flax import nnx

from jaxpar.core import options, usage, zero_layout
from jaxpar.core.trace import active_plan
from jaxpar.parallel import grad_sink, lora, lora_dropout, zero

# What a block keeps for its backward pass: everything, nothing (recompute the
# whole block), or the outputs of its weight matmuls (recompute attention and
# elementwise work, as in Korthikanti et al.'s selective recomputation).
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
options.register_choices("remat", REMAT, called="remat policy")


def remat_wrapper(plan) -> Callable[[Callable], Callable]:
    """Wrap a per-layer function with the plan's activation-checkpointing policy (none outside a plan).

    The ZeRO stage decides what becomes of a layer's gathered parameters.
    ZeRO-2 keeps them for the backward pass whatever else is recomputed.
    ZeRO-3 never keeps them: even `none` checkpoints the block, keeping every
    matmul output but nothing computed from the parameters alone (the gathered
    weights, their concatenations), so the backward pass gathers them again.
    LoRA does the same with its folded weights, W + (alpha / r) A B from a
    dequantized base (QLoRA): the backward pass folds each layer again rather
    than keeping every layer's, so no whole copy of them exists.
    """
    if plan is None:
        return lambda f: f
    policy = REMAT[plan.remat]
    if plan.zero_ranks > 1 and plan.zero == 2 and policy is not None:
        policy = jax.checkpoint_policies.save_from_both_policies(
            policy, jax.checkpoint_policies.save_only_these_names(zero.GATHERED)
        )
    if policy is None and ((plan.zero_ranks > 1 and plan.zero == 3) or plan.lora_rank):
        policy = jax.checkpoint_policies.dots_saveable
    return (lambda f: f) if policy is None else functools.partial(jax.checkpoint, policy=policy)


def scan_layers(block: Callable, stacked: Any, x: Any, *, remat: Callable | None = None):
    """Run `block(layer_params, x)` for each layer of `stacked` (arrays with a leading layer axis).

    `block` returns the new x, or (x, aux); then `scan_layers` returns (x, aux
    stacked along a leading layer axis). `remat` overrides the plan's policy.
    Parameters the step holds sharded over `data` (ZeRO-2/3) are gathered one
    layer at a time; any other tree of stacked arrays runs as it is. A weight
    with LoRA adapters reaches the block as W + (alpha / r) A B, formed per layer
    after the gather (`jaxpar.parallel.lora.fold`).
    """
    usage.mark(usage.STACK)
    remat = remat_wrapper(active_plan()) if remat is None else remat
    sources, entries = zero.layer_sources(stacked)
    returns_aux = []

    def body(h, p):
        out = block(lora.fold(zero.gather_layer(p, entries)), h)
        returns_aux.append(isinstance(out, tuple))
        return out if isinstance(out, tuple) else (out, None)

    sinks = grad_sink.claim(sources)
    if all(s is None for s in sinks):
        y, aux = jax.lax.scan(remat(body), x, sources)
    else:
        y, aux = _scan_into_accumulators(remat, body, x, sources, sinks)
    return (y, aux) if returns_aux[-1] else y


def _scan_into_accumulators(remat: Callable, body: Callable, x, sources, sinks: list):
    """`lax.scan(remat(body), x, sources)` with the claimed accumulators (`sinks`, None where a leaf has none) as
    a carry each layer's backward adds its gradient into (jaxpar.parallel.grad_sink)."""
    leaves, treedef = jax.tree.flatten(sources)
    held = [i for i, s in enumerate(sinks) if s is not None]
    # the scan's use of a held parameter differentiates into its accumulator only: no stacked gradient of it
    leaves = [jax.lax.stop_gradient(leaf) if i in held else leaf for i, leaf in enumerate(leaves)]

    def sunk(carry, xs):
        h, accs = carry
        p, index = xs
        p = list(p)
        accs = list(accs)
        for k, i in enumerate(held):
            p[i], accs[k] = grad_sink.through(p[i], accs[k], index)
        h, aux = body(h, jax.tree.unflatten(treedef, p))
        return (h, tuple(accs)), aux

    start = (x, tuple(sinks[i] for i in held))
    (y, accs), aux = jax.lax.scan(remat(sunk), start, (tuple(leaves), jax.numpy.arange(leaves[0].shape[0])))
    return grad_sink.seed(y, accs), aux


class Stack(nnx.Module):
    """`count` copies of the block `make_block(rngs)` builds, every parameter stacked on a leading `layers` axis.

    Calling the stack runs `block(x, *args)` through every layer in turn with
    `scan_layers`, so ZeRO-2/3 gathers one layer at a time and the plan's remat
    policy applies. The block returns x, or (x, aux) to get aux stacked per
    layer. Each layer's initial parameters come from its own split of `rngs`.
    Other variables (BatchNorm statistics, counters) are read per layer and
    written back as each layer leaves them; RNG streams are read per layer.
    The stacked block is the attribute `layers`: `self.blocks = Stack(...)` puts a block's `up/kernel` at
    `blocks/layers/up/kernel` in parameter paths, describe's listing and checkpoints (which keep it).
    """

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], count: int, *, rngs: nnx.Rngs):
        if count < 1:
            raise ValueError(f"a Stack needs at least one layer, got count={count}")

        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: zero_layout.SCANNED})
        def build(rngs: nnx.Rngs) -> nnx.Module:
            return make_block(rngs)

        self.layers = build(rngs)
        self.count = count

    def __call__(self, x, *args, **kwargs):
        graphdef, params, streams, variables = nnx.split(self.layers, nnx.Param, nnx.RngState, ...)

        def block(layer: dict, h):
            if any(isinstance(v, lora_dropout.Adapted) for v in jax.tree.leaves(
                    layer["params"], is_leaf=lambda v: isinstance(v, lora_dropout.Adapted))):
                raise ValueError("lora_dropout acts in jaxpar's built-in models' tensor layers (jaxpar.parallel.tensor), "
                                 "not in a Stack of your own block: set lora_dropout to 0")
            module = nnx.merge(graphdef, lora.refill(layer["params"], stacked["params"]), layer["streams"],
                               layer["variables"])
            out = module(h, *args, **kwargs)
            y, aux = out if isinstance(out, tuple) else (out, None)
            return y, (aux, nnx.to_pure_dict(nnx.state(module, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))))

        stacked = {"params": nnx.to_pure_dict(params), "streams": nnx.to_pure_dict(streams),
                   "variables": nnx.to_pure_dict(variables)}
        y, (aux, updated) = scan_layers(block, stacked, x)
        if updated:
            nnx.update(self.layers, updated)
        return y if aux is None else (y, aux)

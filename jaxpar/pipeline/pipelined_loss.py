"""A user's NNX model whose repeated layers are a `Stack`, run as a pipeline over `pipe` when the plan has one.

`jaxpar.pipeline.executor.loss` takes functions of parameter trees; this cuts
an NNX model into those pieces (the embedding and head around the stack, the
stack's layers), so a model built from jaxpar's public blocks pipelines as the
built-in Llama does.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.parallel.stack import Stack, scan_layers
from jaxpar.pipeline import executor as pipeline


def pipelined_loss(model: nnx.Module, stack: Stack, embed: Callable, head: Callable, inputs, targets,
                   aux_loss: Callable | None = None, layer_order: str | None = None):
    """The mean loss `head(model, stack(embed(model, inputs)), targets)`, a pipeline over `pipe` when the plan has one.

    `embed(model, inputs) -> x` and `head(model, x, targets) -> mean loss` are
    the model's own code before and after its stacked layers. Under pipe > 1
    the first stage embeds, the stack is cut into stages that run the plan's
    schedule, and every stage runs the head on its share of the sequence
    positions (see `jaxpar.pipeline.executor`). The head must be a mean over positions.
    Blocks that return (x, stats) (an MoE layer's router losses) give
    (loss + aux_loss(sums), sums), sums the stats summed over the layers:
    see `jaxpar.pipeline.executor.Stages` for what `aux_loss` must be. The stack's parameters come in the
    plan's layer order, as a train state holds them (`jaxpar.pipeline.layer_order`); outside jaxpar's train
    step an interleaved plan needs `layer_order` ("pipeline" or "natural") to say which order they are in.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    layer_graphdef, layer_params, layer_rest = nnx.split(stack.layers, nnx.Param, ...)
    if jax.tree.leaves(nnx.to_pure_dict(rest)) or jax.tree.leaves(nnx.to_pure_dict(layer_rest)):
        raise ValueError(
            "pipelined_loss runs models that hold only parameters; this one also holds other variables "
            "(BatchNorm statistics, RNG streams, counters), which a pipeline stage cannot carry yet"
        )
    stacked = nnx.to_pure_dict(layer_params)
    in_stack = {id(a) for a in jax.tree.leaves(stacked)}
    # The embedding and the head see the rest of the model; the stack's arrays are left out (empty).
    outside = jax.tree.map(lambda a: jnp.zeros((0,), a.dtype) if id(a) in in_stack else a, nnx.to_pure_dict(params))

    stages = pipeline.Stages(
        embed=lambda p, tokens: embed(nnx.merge(graphdef, p), tokens),
        layers=lambda s, x: scan_layers(lambda layer, h: nnx.merge(layer_graphdef, layer)(h), s, x),
        head=lambda p, x, t: head(nnx.merge(graphdef, p), x, t),
        aux_loss=aux_loss,
    )
    return pipeline.loss(stages, outside, stacked, outside, inputs, targets, layer_order=layer_order)

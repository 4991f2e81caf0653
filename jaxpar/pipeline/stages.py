"""The model as the pipeline sees it: pure functions of explicit parameters around its stacked layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model cut for pipelining into pure functions of explicit parameters.

    embed(params, tokens[b, s]) -> x[b, s, d] runs before the first stage;
    layers(stacked, x) -> x runs the layers stacked along the leading axis of
        `stacked`; or -> (x, stats), stats a tree of per-layer values stacked on
        a leading layer axis, each a mean over the batch rows (router losses, metrics);
    head(params, x, targets[b, s]) -> mean loss runs after the last stage;
    aux_loss(sums) -> scalar added to the loss, from the stats summed over
        all layers. It must be a sum of per-layer terms (linear in `sums`, as
        MoE auxiliary losses are), so that each stage back-propagates its own
        layers' part. `loss` returns (loss, sums) when the layers return stats.
    """

    embed: Callable[[Any, jax.Array], jax.Array]
    layers: Callable[[Any, jax.Array], Any]
    head: Callable[[Any, jax.Array, jax.Array], jax.Array]
    aux_loss: Callable[[Any], jax.Array] | None = None

    def run_layers(self, stacked, x) -> tuple[jax.Array, Any]:
        """(x after the layers, their stats summed over the layers in fp32: {} for layers without stats)."""
        out = self.layers(stacked, x)
        y, stats = out if isinstance(out, tuple) else (out, {})
        return y, jax.tree.map(lambda s: jnp.sum(s.astype(jnp.promote_types(s.dtype, jnp.float32)), axis=0), stats)

    def with_aux(self, value: jax.Array, sums) -> jax.Array:
        """The head's loss plus `aux_loss(sums)` (nothing to add without stats or an aux_loss)."""
        if self.aux_loss is None or not jax.tree.leaves(sums):
            return value
        return value + self.aux_loss(sums)

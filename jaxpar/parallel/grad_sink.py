"""Microbatch gradients summed into their accumulators by the backward layer scan itself, in place.

A step that accumulates microbatches would otherwise hold each microbatch's stacked gradient of the layer
stack, which the backward scan writes slot by slot, beside the accumulators, and add the two after: one
more parameter-sized buffer in the held dtype (fp32 under bf16 and fp16: the transpose of the cast at use),
the largest transient of such a step under ZeRO-3. Here an accumulator rides its stack's layer scan as a
carry that the forward passes through unchanged: `seed` hands its final value back as its own cotangent,
and `through` adds each layer's gradient into that layer's slot of it, so the backward scan's carry comes
out as the new accumulator (`jaxpar.parallel.stack.scan_layers`). Each element is acc + g, as before.
An accumulator is claimed by one scan at most; any other use of its parameter is differentiated as usual
(`jaxpar.train.step` adds both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxpar.core import trace


@dataclasses.dataclass
class Sink:
    """One trained parameter's accumulator, offered to the layer scan that uses the parameter stacked."""

    accumulator: Any
    claimed: bool = False


def offer(trained, accumulators) -> list[Sink]:
    """Offer each leaf of `accumulators` to the scan over its leaf of `trained` (inside `zero.layer_registry`)."""
    registry = trace.current().zero_layers
    sinks = [Sink(a) for a in jax.tree.leaves(accumulators)]
    if registry is not None:
        for leaf, sink in zip(jax.tree.leaves(trained), sinks):
            registry["sink", id(leaf)] = (leaf, sink)
    return sinks


def claim(sources) -> list:
    """For each leaf of a layer scan's sources, its accumulator (claimed now) or None."""
    registry = trace.current().zero_layers or {}
    out = []
    for leaf in jax.tree.leaves(sources):
        found = registry.get(("sink", id(leaf)))
        if found is None or found[0] is not leaf or found[1].claimed:
            out.append(None)
            continue
        found[1].claimed = True
        out.append(found[1].accumulator)
    return out


@jax.custom_vjp
def through(p, acc, index):
    """`p` (a layer's slice of a stacked parameter) and its accumulator, unchanged; backward, p's cotangent is
    added into the accumulator's slot `index` instead of being returned."""
    return p, acc


def _through_fwd(p, acc, index):
    return (p, acc), index


def _through_bwd(index, cts):
    ct_p, ct_acc = cts
    return None, ct_acc.at[index].add(ct_p.astype(ct_acc.dtype)), None


through.defvjp(_through_fwd, _through_bwd)


@jax.custom_vjp
def seed(y, accumulators):
    """`y` unchanged; backward, the accumulators' cotangent is their own value (their sums so far)."""
    return y


def _seed_fwd(y, accumulators):
    return y, accumulators


def _seed_bwd(accumulators, ct_y):
    return ct_y, accumulators


seed.defvjp(_seed_fwd, _seed_bwd)

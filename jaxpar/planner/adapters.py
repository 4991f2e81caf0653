"""LoRA and QLoRA in the planner's inventory: adapters that train beside a frozen base, maybe held quantized.

`with_lora` turns a model's inventory into what `--lora-rank` trains: every
parameter frozen (no gradient, no optimizer state, no gradient sum), and beside
each targeted weight an A [stacked..., in..., r] and a B [stacked..., r,
out...] that train, sharded like the weight's input and output dimensions
(`jaxpar.parallel.lora`). With `--base-dtype` the layer stack's matrices are
held at their quantized bytes per value: NF4 0.5 + 4 / 64, int8 1 + 4 / 64
(`jaxpar.parallel.quantized_base`).
"""

from __future__ import annotations

import dataclasses
import fnmatch

from jaxpar.parallel import lora, quantize, quantized_base
from jaxpar.planner.model import Leaf, Model


def _adapters(leaf: Leaf, rank: int) -> list[Leaf]:
    """A and B of one weight, named as `jaxpar.parallel.lora` names them."""
    lead = 0
    while lead < len(leaf.names) and leaf.names[lead] in lora.STACKED:
        lead += 1
    n_in = 2 if leaf.names[lead] in lora.HEADS else 1
    cut = lead + n_in
    return [Leaf(leaf.path + lora.A, (*leaf.shape[:cut], rank), (*leaf.names[:cut], None)),
            Leaf(leaf.path + lora.B, (*leaf.shape[:lead], rank, *leaf.shape[cut:]),
                 (*leaf.names[:lead], None, *leaf.names[cut:]))]


def with_lora(model: Model, rank: int, targets=("q", "k", "v", "o"), base_dtype: str = "none") -> Model:
    """`model` as `--lora-rank rank --lora-targets targets --base-dtype base_dtype` trains it."""
    if rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {rank}")
    if base_dtype != "none":
        quantize.check_kind(base_dtype)
    targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
    patterns = lora.patterns_of(targets)
    held = quantize.bytes_per_value(base_dtype) if base_dtype != "none" else 0.0
    leaves = []
    for leaf in model.leaves:
        name = leaf.path.split(".")[-1]
        quantized = held if leaf.stacked and name in quantized_base.MATRICES else 0.0
        adapted = any(fnmatch.fnmatchcase(leaf.path.replace(".", "/"), p) for p in patterns)
        leaves.append(dataclasses.replace(leaf, trained=False, adapted=adapted, held_bytes=quantized))
        if adapted:
            leaves += _adapters(leaf, rank)
    if not any(leaf.trained for leaf in leaves):
        raise ValueError(f"--lora-targets {','.join(targets)} names no weight of {model.name}")
    options = (("lora_rank", rank), ("lora_targets", ",".join(targets)),
               *((("base_dtype", base_dtype),) if base_dtype != "none" else ()))
    return dataclasses.replace(model, leaves=tuple(leaves), plan_options=options)

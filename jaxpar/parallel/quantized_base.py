"""QLoRA's frozen base: the layer stack's matrices held as int8 or NF4 codes with per-block scales.

`store` replaces every matrix of a model's layer stacks that the LoRA short
names name (q, k, v, o, gate, up, down, and each expert's), adapted or not, by
its codes (`jaxpar.parallel.quantize`), an `nnx.Param` that keeps the weight's
logical names, and puts `w_quant_scales` (fp32, one per 64 values of the last
dimension, the same names) beside it: every plan shards codes and scales like
the weight, each device holding whole blocks (`check_plan`). All of them, as
the QLoRA paper does, because the base's bytes are what QLoRA saves; the
embedding table, the head and the norms stay in the compute dtype (outside the
layer scan they would be dequantized whole every step).

`dequantized` restores the compute dtype where `jaxpar.parallel.lora.fold`
forms W + (alpha / r) A B: per layer inside `jaxpar.scan_layers`, after that
layer's ZeRO gather, so a whole dequantized copy of the stack never exists.
The codes are integers: no gradient, no optimizer state and no cast reach them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core import options, zero_layout
from jaxpar.core import rules as rules_lib
from jaxpar.parallel import quantize

SCALES = "_quant_scales"
options.register_choices("base_dtype", ("none", *quantize.KINDS), called="base_dtype (--base-dtype)")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "expert_gate", "expert_up", "expert_down")
CODE_KINDS = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "nf4"}  # the codes' dtype names their kind


def _matrices(model: nnx.Module):
    """(path, module, attribute) of each stacked matrix of `model` that `store` quantizes."""
    for path, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            names = tuple(value.get_metadata().get("out_sharding") or ()) if type(value) is nnx.Param else ()
            if name in MATRICES and names[:1] in ((zero_layout.SCANNED,), (zero_layout.PREFIX_SCANNED,)):
                yield "/".join(str(p) for p in (*path, name)), module, name


def store(model: nnx.Module, kind: str, block: int = quantize.BLOCK) -> None:
    """Hold `model`'s stacked matrices as `kind` codes with a scale per `block` values (after `lora.apply`, whose
    adapters take the weight's dtype); refused in one line where a last dimension is not whole blocks."""
    quantize.check_kind(kind)
    for path, module, name in _matrices(model):
        weight = getattr(module, name)
        shape = weight.get_value().shape
        if shape[-1] % block:
            raise ValueError(f"--base-dtype {kind}: {path}'s last dimension ({shape[-1]}, of shape {list(shape)}) is "
                             f"not a whole number of {block}-value blocks")
        q = quantize.quantize(weight.get_value(), kind, block)
        metadata = {k: v for k, v in weight.get_metadata().items() if k in ("out_sharding", "eager_sharding")}
        weight.set_value(q.codes)
        setattr(module, name + SCALES, nnx.Param(q.scales, **metadata))


def quantized_like(given, like):
    """`given` (a parameter tree with full weights, e.g. imported ones) quantized where `like` holds codes."""
    if not isinstance(like, dict):
        return given
    out = {k: quantized_like(given[k], v) if k in given else v for k, v in like.items()}
    for key, codes in like.items():
        if isinstance(key, str) and key + SCALES in like and key in given:
            q = quantize.quantize(given[key], CODE_KINDS[jnp.dtype(codes.dtype)], _block(codes, like[key + SCALES]))
            out[key], out[key + SCALES] = q.codes, q.scales
    return out


def _block(codes, scales) -> int:
    """Values per scale, from the codes' and scales' last dimensions (two NF4 codes to a byte)."""
    per_byte = 2 if CODE_KINDS[jnp.dtype(codes.dtype)] == "nf4" else 1
    return codes.shape[-1] * per_byte // scales.shape[-1]


def dequantized(tree: dict, keep: bool = False) -> dict:
    """One level of a parameter tree with each weight held as codes restored from them and its scales, in the
    scales' (compute) dtype; `keep`: the scales stay in the tree (unread), else they are dropped. A weight already
    restored (a `lora.merged` module's, folded again by the inference forward) is left as it is."""
    out = {}
    for key, value in tree.items():
        if isinstance(key, str) and key.endswith(SCALES) and key[:-len(SCALES)] in tree:
            if keep:
                out[key] = value
        elif isinstance(key, str) and key + SCALES in tree and jnp.dtype(value.dtype) in CODE_KINDS:
            scales = tree[key + SCALES]
            q = quantize.Quantized(value, scales, CODE_KINDS[jnp.dtype(value.dtype)], _block(value, scales))
            out[key] = quantize.dequantize(q, scales.dtype)
        else:
            out[key] = value
    return out


def check_plan(logical, plan) -> None:
    """Refuse in one line a quantized weight whose last dimension, split over the plan's non-ZeRO axes (ZeRO
    gathers a layer before it is dequantized), leaves a device a part that is not whole blocks."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(logical, is_leaf=rules_lib.is_logical)[0]:
        key = getattr(path[-1], "key", None)
        if not (isinstance(key, str) and key.endswith(SCALES)):
            continue
        names, codes = tuple(leaf.names), _leaf_at(logical, path[:-1], key[:-len(SCALES)])
        block = _block(codes, leaf)
        n = leaf.shape[-1] * block  # the weight's last dimension
        spec = rules_lib.resolve_spec(names, (*leaf.shape[:-1], n), plan.shape, plan.logical_rules,
                                      check=False)
        entry = spec[len(names) - 1] if len(spec) == len(names) else None
        axes = [a for a in zero_layout.axes_of(entry) if a not in zero_layout.AXES]
        ways = math.prod(plan.shape[a] for a in axes)
        if n % ways or (n // ways) % block:
            weight = "/".join(str(getattr(k, "key", k)) for k in (*path[:-1], key[:-len(SCALES)]))
            raise ValueError(f"--base-dtype {CODE_KINDS[jnp.dtype(codes.dtype)]}: {weight}'s last dimension "
                             f"({names[-1]!r}, {n}) splits over {', '.join(f'{a}={plan.shape[a]}' for a in axes)} "
                             f"into {n / ways:g} per device, not a multiple of the {block}-value block")


def _leaf_at(tree, path, key):
    for part in path:
        tree = tree[getattr(part, "key", part)]
    return tree[key]

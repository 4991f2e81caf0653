"""Which layers attend locally: a config's sliding window, its local/global layer pattern and the local layers'
rotary base.

A config with `sliding_window` W and `sliding_pattern` P (models.llama.LlamaConfig) makes every layer
local (P = 1: Mistral) or layer i global when (i + 1) % P == 0 and local otherwise (P = 2: Gemma 2,
P = 6: Gemma 3, whose n_layers need not be a multiple: the last layers are local). With
`rope_local_theta` the local layers rotate with their own unscaled base (Gemma 3); with `global_nope` the
global layers do not rotate and the local ones attend within chunks (`attention_chunk`: Llama 4).
A layer's window must be a Python value where it is traced, so that the attention's masks and the
ring form's block plan are static: the blocks run in groups of one pattern each (`run_groups`, a scan
over the groups, each running its P blocks with their own windows, then a scan over the local layers
left over), the stacked parameters keeping their [layers, ...] layout. The KV-cache decode masks by a
window per layer instead (`layer_windows`, scanned beside the layers), and rotates by each layer's
frequencies (`layer_frequencies`). The configs here are any with those fields; this module knows no model.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.trace import active_plan
from jaxpar.models.rotary import rope_frequencies
from jaxpar.parallel import zero
from jaxpar.parallel.stack import scan_layers


def check(cfg) -> None:
    """Raise ValueError for attention fields that cannot act (called by the config's __post_init__)."""
    window, pattern = cfg.sliding_window, cfg.sliding_pattern
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {window!r}")
    if isinstance(pattern, bool) or not isinstance(pattern, numbers.Integral) or pattern < 1:
        raise ValueError(f"sliding_pattern must be an int >= 1, got {pattern!r}")
    chunk = cfg.attention_chunk
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1):
        raise ValueError(f"attention_chunk must be None or an int >= 1, got {chunk!r}")
    if pattern > 1 and window is None and chunk is None and not cfg.global_nope:
        raise ValueError(f"sliding_pattern={pattern} alternates local and global layers but sliding_window is None: "
                         "set the local layers' window (or attention_chunk, or global_nope)")
    if cfg.global_nope and pattern == 1:
        raise ValueError("global_nope=True leaves the global layers unrotated, but sliding_pattern=1 makes no layer "
                         "global: set sliding_pattern P (layer i global iff (i + 1) % P == 0)")
    if cfg.temperature_floor is not None and not (cfg.global_nope or cfg.rope_type == "none"):
        raise ValueError(f"temperature_floor={cfg.temperature_floor} scales the queries of NoPE layers, and this "
                         "config has none: set global_nope=True (with sliding_pattern > 1)")
    for name in ("attn_softcap", "query_scale", "rope_local_theta", "temperature_floor"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0):
            raise ValueError(f"{name} must be None or a number > 0, got {value!r}")
    if cfg.rope_local_theta is not None and pattern == 1:
        raise ValueError(f"rope_local_theta={cfg.rope_local_theta} rotates local layers apart from global ones, but "
                         f"sliding_pattern=1 makes every layer {'global' if window is None else 'local'}: set "
                         "rope_theta instead")


def check_pipeline_chunks(cfg, pipe: int, virtual_stages: int) -> None:
    """Raise ValueError, before tracing, when pipe x virtual_stages chunks cannot each hold whole patterns."""
    pattern = getattr(cfg, "sliding_pattern", 1)
    chunks = pipe * virtual_stages if pipe > 1 else 1
    if pattern > 1 and chunks > 1 and cfg.n_layers % (chunks * pattern):
        raise ValueError(f"n_layers={cfg.n_layers} do not cut into pipe={pipe} x virtual_stages={virtual_stages} "
                         f"chunks of whole local/global patterns (sliding_pattern={pattern}); choose pipe x "
                         f"virtual_stages dividing n_layers / {pattern} = {cfg.n_layers // pattern}")


def layer_window(cfg, layer: int) -> int | None:
    """The sliding window of layer `layer` (None: a global layer)."""
    if cfg.sliding_window is None or (cfg.sliding_pattern > 1 and (layer + 1) % cfg.sliding_pattern == 0):
        return None
    return cfg.sliding_window


def is_global(cfg, layer: int) -> bool:
    """Layer `layer` is a global one of the local/global pattern."""
    return cfg.sliding_pattern > 1 and (layer + 1) % cfg.sliding_pattern == 0


def layer_config(cfg, layer: int):
    """`cfg` for one layer: its own window (or none), sliding_pattern 1 and, a local layer under
    `rope_local_theta`, its unscaled rotary base; under `global_nope` a global layer rotates not, attends
    unchunked and keeps the query temperature, a local one keeps the chunks and the q/k L2 norm;
    `cfg` itself when all layers agree."""
    if cfg.sliding_pattern == 1:
        return cfg
    window, glob = layer_window(cfg, layer), is_global(cfg, layer)
    rope = {} if cfg.rope_local_theta is None or glob else {"rope_theta": cfg.rope_local_theta, "rope_type": "default"}
    if cfg.global_nope:
        rope = ({"rope_type": "none", "attention_chunk": None, "qk_l2_norm": False} if glob
                else {**rope, "temperature_floor": None})
    return dataclasses.replace(cfg, sliding_window=window, sliding_pattern=1, rope_local_theta=None, global_nope=False,
                               **rope)


def attention_options(cfg) -> dict:
    """`causal_attention`'s keyword options for a layer of `cfg` (a config `layer_config` resolved)."""
    if cfg.sliding_pattern > 1:
        raise ValueError(f"sliding_pattern={cfg.sliding_pattern}: which layers are local depends on the layer index; "
                         "run the blocks with models.llama.run_layers (or give block i layer_config(cfg, i))")
    return {"window": cfg.sliding_window, "softcap": cfg.attn_softcap, "scale": cfg.query_scale}


def layer_windows(cfg) -> np.ndarray | None:
    """Each layer's window [n_layers] int32, a global layer's beyond any distance; None without a window."""
    if cfg.sliding_window is None:
        return None
    wide = np.iinfo(np.int32).max
    return np.array([wide if (w := layer_window(cfg, i)) is None else w for i in range(cfg.n_layers)], np.int32)


def layer_frequencies(cfg, head_dim: int) -> np.ndarray | None:
    """Each layer's rotary inverse frequencies [n_layers, head_dim / 2] under `rope_local_theta` or `global_nope`
    (a NoPE layer's are 0); None without."""
    if cfg.rope_local_theta is None and not cfg.global_nope:
        return None
    return np.stack([rope_frequencies(layer_config(cfg, i), head_dim) for i in range(cfg.n_layers)])


def layer_options(cfg) -> dict[str, np.ndarray]:
    """Llama 4's per-layer attention options as arrays [n_layers] for the inference scan (empty without them):
    `chunk` (an unchunked layer's beyond any position), `l2` (the q/k L2 norm) and `temperature` (the query
    temperature's scale, 0 on a rotating layer: a factor of exactly 1)."""
    layers = [layer_config(cfg, i) for i in range(cfg.n_layers)]
    options = {}
    if cfg.attention_chunk is not None:
        wide = np.iinfo(np.int32).max
        options["chunk"] = np.array([c.attention_chunk or wide for c in layers], np.int32)
    if cfg.qk_l2_norm:
        options["l2"] = np.array([c.qk_l2_norm for c in layers], bool)
    if cfg.temperature_floor is not None:
        options["temperature"] = np.array([c.temperature_scale if c.temperature_floor else 0.0 for c in layers],
                                          np.float32)
    return options


def run_groups(block: Callable, stacked, x, cfg, remat: Callable | None = None):
    """`block(p, x, layer_cfg)` over the leading layer axis of `stacked`, in scanned groups of one pattern; a
    block returning (x, aux) gets (x, aux stacked per layer) back, as from `scan_layers`.

    A block that returns (x, statistics) (an MoE block's routing) makes this return (x, statistics stacked along
    a leading axis whose sum is their sum over the layers: one entry per pattern, summed over its blocks, then
    one per layer left over).

    `stacked` is all layers (whose local layers past the last whole pattern run after the groups) or a
    pipeline chunk (contiguous layers from a multiple of its size: see jaxpar.pipeline.layer_order); a
    chunk that does not start a pattern is refused, naming the sizes.
    """
    pattern = cfg.sliding_pattern
    layers = jax.tree.leaves(stacked)[0].shape[0]
    tail = cfg.n_layers % pattern if layers == cfg.n_layers else 0
    if (layers - tail) % pattern:
        plan = active_plan()
        cut = "" if plan is None else f" (pipe={plan.shape['pipe']} x virtual_stages={plan.virtual_stages} chunks)"
        raise ValueError(f"a pipeline chunk of {layers} layers{cut} is not a multiple of sliding_pattern={pattern}: "
                         f"each chunk must start a local/global pattern so that layer i stays global iff "
                         f"(i + 1) % {pattern} == 0; choose pipe x virtual_stages so that n_layers={cfg.n_layers} / "
                         f"(pipe x virtual_stages) divides by {pattern}")

    def group(p, h):  # one pattern's blocks, each with its own static window
        auxes = []
        for i in range(pattern):
            h = block(jax.tree.map(lambda a: a[i], p), h, layer_config(cfg, i))
            if isinstance(h, tuple):  # (x, the layer's aux), stacked per layer as scan_layers does
                h, aux = h
                auxes.append(aux)
        return (h, jax.tree.map(lambda *a: jnp.stack(a), *auxes)) if auxes else h

    whole, per_layer = layers - tail, []
    if whole:
        x = scan_layers(group, zero.regroup(jax.tree.map(lambda a: a[:whole], stacked), whole // pattern), x,
                        remat=remat)
        if isinstance(x, tuple):
            x, aux = x
            per_layer.append(jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), aux))
    if tail:  # layers whole..n-1 are pattern positions 0..tail-1 < pattern - 1: all local, alike
        x = scan_layers(lambda p, h: block(p, h, layer_config(cfg, 0)), jax.tree.map(lambda a: a[whole:], stacked),
                        x, remat=remat)
        if isinstance(x, tuple):
            x, aux = x
            per_layer.append(aux)
    return (x, jax.tree.map(lambda *a: jnp.concatenate(a), *per_layer)) if per_layer else x

"""Which layers attend locally: a config's sliding window and its local/global layer pattern.

A config with `sliding_window` W and `sliding_pattern` P (models.llama.LlamaConfig) makes every layer
local (P = 1: Mistral) or layer i global when (i + 1) % P == 0 and local otherwise (P = 2: Gemma 2).
A layer's window must be a Python value where it is traced, so that the attention's masks and the
ring form's block plan are static: the blocks run in groups of one pattern each (`run_groups`, a scan
over the groups, each running its P blocks with their own windows), the stacked parameters keeping
their [layers, ...] layout. The KV-cache decode masks by a window per layer instead (`layer_windows`,
scanned beside the layers). The configs here are any with those fields; this module knows no model.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

import jax
import numpy as np

from jaxpar.core.trace import active_plan
from jaxpar.parallel import zero
from jaxpar.parallel.stack import scan_layers


def check(cfg) -> None:
    """Raise ValueError for attention fields that cannot act (called by the config's __post_init__)."""
    window, pattern = cfg.sliding_window, cfg.sliding_pattern
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {window!r}")
    if isinstance(pattern, bool) or not isinstance(pattern, numbers.Integral) or pattern < 1:
        raise ValueError(f"sliding_pattern must be an int >= 1, got {pattern!r}")
    if pattern > 1 and window is None:
        raise ValueError(f"sliding_pattern={pattern} alternates local and global layers but sliding_window is None: "
                         "set the local layers' window")
    if pattern > 1 and cfg.n_layers % pattern:
        raise ValueError(f"n_layers={cfg.n_layers} is not a multiple of sliding_pattern={pattern}: the layers run in "
                         "groups of one pattern each")
    for name in ("attn_softcap", "query_scale"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0):
            raise ValueError(f"{name} must be None or a number > 0, got {value!r}")


def check_pipeline_chunks(cfg, pipe: int, virtual_stages: int) -> None:
    """Raise ValueError, before tracing, when pipe x virtual_stages chunks cannot each hold whole patterns."""
    pattern = getattr(cfg, "sliding_pattern", 1) if getattr(cfg, "sliding_window", None) else 1
    chunks = pipe * virtual_stages if pipe > 1 else 1
    if pattern > 1 and cfg.n_layers % (chunks * pattern):
        raise ValueError(f"n_layers={cfg.n_layers} do not cut into pipe={pipe} x virtual_stages={virtual_stages} "
                         f"chunks of whole local/global patterns (sliding_pattern={pattern}); choose pipe x "
                         f"virtual_stages dividing n_layers / {pattern} = {cfg.n_layers // pattern}")


def layer_window(cfg, layer: int) -> int | None:
    """The sliding window of layer `layer` (None: a global layer)."""
    if cfg.sliding_window is None or (cfg.sliding_pattern > 1 and (layer + 1) % cfg.sliding_pattern == 0):
        return None
    return cfg.sliding_window


def layer_config(cfg, layer: int):
    """`cfg` for one layer: its own window (or none) and sliding_pattern 1; `cfg` itself when all layers agree."""
    if cfg.sliding_pattern == 1:
        return cfg
    return dataclasses.replace(cfg, sliding_window=layer_window(cfg, layer), sliding_pattern=1)


def attention_options(cfg) -> dict:
    """`causal_attention`'s keyword options for a layer of `cfg` (a config `layer_config` resolved)."""
    if cfg.sliding_pattern > 1:
        raise ValueError(f"sliding_pattern={cfg.sliding_pattern}: which layers are local depends on the layer index; "
                         "run the blocks with models.llama.run_layers (or give block i layer_config(cfg, i))")
    return {"window": cfg.sliding_window, "softcap": cfg.attn_softcap, "scale": cfg.query_scale}


def layer_windows(cfg) -> tuple:
    """() without a window; else (each layer's window [n_layers] int32, a global layer's beyond any distance)."""
    if cfg.sliding_window is None:
        return ()
    wide = np.iinfo(np.int32).max
    return (np.array([wide if (w := layer_window(cfg, i)) is None else w for i in range(cfg.n_layers)], np.int32),)


def run_groups(block: Callable, stacked, x, cfg, remat: Callable | None = None):
    """`block(p, x, layer_cfg)` over the leading layer axis of `stacked`, in scanned groups of one pattern.

    `stacked` is all layers or a pipeline chunk (contiguous layers from a multiple of its size: see
    jaxpar.pipeline.layer_order); a chunk that does not start a pattern is refused, naming the sizes.
    """
    pattern = cfg.sliding_pattern
    layers = jax.tree.leaves(stacked)[0].shape[0]
    if layers % pattern:
        plan = active_plan()
        cut = "" if plan is None else f" (pipe={plan.shape['pipe']} x virtual_stages={plan.virtual_stages} chunks)"
        raise ValueError(f"a pipeline chunk of {layers} layers{cut} is not a multiple of sliding_pattern={pattern}: "
                         f"each chunk must start a local/global pattern so that layer i stays global iff "
                         f"(i + 1) % {pattern} == 0; choose pipe x virtual_stages so that n_layers={cfg.n_layers} / "
                         f"(pipe x virtual_stages) divides by {pattern}")

    def group(p, h):  # one pattern's blocks, each with its own static window
        for i in range(pattern):
            h = block(jax.tree.map(lambda a: a[i], p), h, layer_config(cfg, i))
        return h

    return scan_layers(group, zero.regroup(stacked, layers // pattern), x, remat=remat)

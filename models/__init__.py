"""Reference models, by name: each entry is (constructor, default config).

Models name dimensions logically and never a mesh axis; any config field can be
overridden (e.g. from the `[model]` table of a `--config` TOML file).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxpar.models.llama import CONFIGS as LLAMA_CONFIGS
from jaxpar.models.llama import Llama
from jaxpar.models.moe import CONFIGS as MOE_CONFIGS
from jaxpar.models.moe import MoeLlama

MODELS: dict[str, tuple[Callable[..., nnx.Module], Any]] = {
    **{name: (Llama, config) for name, config in LLAMA_CONFIGS.items()},
    **{name: (MoeLlama, config) for name, config in MOE_CONFIGS.items()},
}


def model_config(name: str, overrides: dict | None = None):
    """The named config with `overrides` applied; unknown names or fields are errors."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    config = MODELS[name][1]
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for model {name!r}; fields: {sorted(fields)}")
    return dataclasses.replace(config, **overrides)


def model_factory(name: str, config, seed: int) -> Callable[[], nnx.Module]:
    """A zero-argument constructor (what jaxpar.train.state.init_state takes)."""
    constructor = MODELS[name][0]
    return lambda: constructor(config, nnx.Rngs(seed))

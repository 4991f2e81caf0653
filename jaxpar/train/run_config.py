"""The config a run saves with every checkpoint, and what changed between a saved one and the current run.

A checkpoint directory refuses another model (`model_changes`); a resumed run
refuses data that would give other batches (`jaxpar.data.epochs`); both name
each difference as `key: saved -> current`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxpar.core.plan import Plan
from jaxpar.models.llama import LlamaConfig


def run_config(train: Any, model_config: Any, plan: Plan, hf_config: dict | None = None) -> dict:
    """The config saved with every checkpoint, as JSON-ready values: model, mesh, plan and train.

    `train.model` names the model built (for `--init-from`, the one its weights belong to). `hf_config`, the
    Hugging Face config.json the weights were imported from, rides along under `model` so that an export
    writes its fields back (`jaxpar.interop.hf_config.config_to_hf`).
    """
    options = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "mesh"}
    model = {"name": train.model, "config": dataclasses.asdict(model_config)}
    config = {
        "model": model if hf_config is None else {**model, "hf_config": hf_config},
        "mesh": plan.shape,
        "plan": options,
        "train": dataclasses.asdict(train),
    }
    return json.loads(json.dumps(config))


def differences(saved: dict, current: dict) -> list[str]:
    """`key: saved -> current` for every top-level key whose value differs."""
    keys = sorted(set(saved) | set(current))
    missing = "(absent)"
    return [f"{k}: {saved.get(k, missing)} -> {current.get(k, missing)}"
            for k in keys if saved.get(k) != current.get(k)]


def with_later_options_off(saved: dict, current: dict) -> dict:
    """`saved` with the model options a later jaxpar added (absent there) read as off (False, None or the Llama's
    default, e.g. mlp_activation="silu"), as the model that wrote it ran: a checkpoint from before, say,
    `qkv_bias` existed is the same model, not another."""
    off = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
    later = {k: v for k, v in current.items()
             if k not in saved and (v in (False, None) or (k in off and v == off[k]))}
    return {**saved, **later}


def model_changes(saved: dict, current: dict) -> list[str]:
    """How the model of a saved config (`{"name", "config"}`) differs from the current one; empty if it is the same
    model (options added since it was written read as off)."""
    changed = differences(with_later_options_off(saved["config"], current["config"]), current["config"])
    if saved["name"] != current["name"]:
        changed.insert(0, f"name: {saved['name']} -> {current['name']}")
    return changed

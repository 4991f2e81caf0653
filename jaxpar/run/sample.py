"""Sampling on a training plan: G completions per prompt with the KV-cache decode, on the parameters as they train.

The decode (`jaxpar.models.inference`'s cache, `run/generate.py`'s token choice) runs as one jitted function
under the plan, on the parameters where the training state holds them: no gather onto one device and no second
copy (a LoRA model's adapters are folded one layer at a time inside the layer scan; a QLoRA base is dequantized
there too). Rows are the prompts, each repeated G times, left-padded to one length, split over the plan's batch
axes like a training batch. A row that emits one of the stop tokens emits `pad` after it; the completion mask is
TRL's (`jaxpar.objectives.grpo.completion_mask`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.core.plan import Plan
from jaxpar.objectives.grpo import completion_mask
from jaxpar.parallel import lora
from jaxpar.run.generate import left_pad
from jaxpar.run.generate import sample as choose_token
from jaxpar.train.state import ModelDef, describe


@dataclasses.dataclass(frozen=True)
class Samples:
    """What `sample` drew: rows are the prompts in order, each repeated `group_size` times."""

    prompt_ids: list[list[int]]  # each row's prompt
    completion_ids: np.ndarray  # [rows, max_new_tokens] int32, `pad` after a row's first stop token
    completion_mask: np.ndarray  # [rows, max_new_tokens] int32: TRL's (through the first stop token)
    lengths: np.ndarray  # [rows]: tokens through the first stop token (max_new_tokens where there is none)
    truncated: np.ndarray  # [rows] bool: no stop token within max_new_tokens (cut at the length limit)
    group_size: int

    def completions(self) -> list[list[int]]:
        """Each row's completion tokens, through its stop token."""
        return [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.lengths)]


def _decode(model: ModelDef, max_new_tokens: int, temperature: float, top_p: float, stops: tuple, pad: int,
            params, tokens, mask, key):
    """New tokens [rows, max_new_tokens]: prefill, then one scanned decode step per token."""
    module = model.merge(lora.fold(params, unstacked_only=True, keep=True))
    rows, length = tokens.shape
    cache = module.init_cache(rows, length + max_new_tokens, jnp.dtype(module.cfg.param_dtype))
    logits, cache = module.decode(tokens, cache, mask)
    stop_ids = jnp.asarray(stops, jnp.int32)

    def step(carry, key):
        cache, last, done = carry
        token = choose_token(last, key, temperature, top_p)
        token = jnp.where(done, pad, token)
        done = done | jnp.isin(token, stop_ids) if stops else done
        logits, cache = module.decode(token[:, None], cache)
        return (cache, logits[:, -1], done), token

    done = jnp.zeros((rows,), bool)
    _, new = jax.lax.scan(step, (cache, logits[:, -1], done), jax.random.split(key, max_new_tokens))
    return new.T


def _parts(model, params):
    """(ModelDef, parameters) from a ModelDef with its parameters, or an NNX module holding them."""
    if isinstance(model, ModelDef):
        if params is None:
            raise ValueError("sample(model, plan, prompts, params): a ModelDef needs its parameters (state.params)")
        return model, params
    if isinstance(model, nnx.Module):
        return describe(lambda: model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    raise TypeError(f"model must be a jaxpar ModelDef (jaxpar.describe) or an NNX module, got {type(model).__name__}")


_COMPILED: dict = {}  # (id of the ModelDef, options) -> its jitted decode: one compile per model and options


def _compiled(model: ModelDef, *options):
    key = (id(model), *options)
    if key not in _COMPILED:
        _COMPILED[key] = (model, jax.jit(functools.partial(_decode, model, *options)))
    return _COMPILED[key][1]


def check_options(plan: Plan, max_new_tokens: int, temperature: float, top_p: float, group_size: int) -> None:
    """Refuse in one line what the decode cannot do, before anything compiles."""
    if plan.shape["pipe"] > 1 or plan.shape["context"] > 1:
        raise ValueError(f"sampling runs the layers in one scan over whole rows: a plan with pipe=1 and context=1, "
                         f"got pipe={plan.shape['pipe']}, context={plan.shape['context']}")
    if max_new_tokens < 1 or group_size < 1:
        raise ValueError(f"max_new_tokens and group_size must be >= 1, got {max_new_tokens}, {group_size}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")


def sample(model, plan: Plan, prompts: Sequence[Sequence[int]], params=None, *, group_size: int = 1,
           max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
           pad: int = 0, seed: int = 0, mask_truncated: bool = False) -> Samples:
    """`group_size` completions of each prompt (token ids), drawn on `plan`'s mesh.

    `model`: a ModelDef (`jaxpar.describe`) with `params` (a TrainState's, as they are sharded for training), or
    an NNX module. Temperature 0 is greedy. Every row stops at its first token in `stop_tokens`.
    """
    check_options(plan, max_new_tokens, temperature, top_p, group_size)
    model, params = _parts(model, params)
    vocab = getattr(getattr(model.merge(params), "cfg", None), "vocab", None)
    rows = [list(p) for p in prompts for _ in range(group_size)]
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if vocab is not None and not 0 <= int(t) < vocab]
        if not prompt or bad:
            raise ValueError(f"prompt {i}: " + (f"token {bad[0]} is outside the model's vocabulary of {vocab}"
                                                if bad else "it has no tokens"))
    ways = plan.axis_size(*plan.batch_axes)
    tokens, mask = left_pad(rows, -(-len(rows) // ways) * ways, pad)
    sharding = plan.sharding(plan.batch_spec(2))
    tokens, mask = jax.device_put(tokens, sharding), jax.device_put(mask, sharding)
    params = jax.device_put(params, plan.shardings(plan.param_specs(model.logical)))  # no move where already so
    stops = tuple(int(t) for t in stop_tokens)
    fn = _compiled(model, max_new_tokens, float(temperature), float(top_p), stops, int(pad))
    with plan.activate():
        new = np.asarray(jax.device_get(fn(params, tokens, mask, jax.random.key(seed))))[: len(rows)]
    truncated = ~np.isin(new, stops).any(axis=1) if stops else np.ones(len(rows), bool)
    lengths = completion_mask(new, stops).sum(axis=1)
    return Samples(rows, new, completion_mask(new, stops, mask_truncated), lengths, truncated, group_size)

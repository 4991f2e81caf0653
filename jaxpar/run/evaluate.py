"""Loss and perplexity of a model on held-out data (`jaxpar.data.holdout`), for `--eval-every` and `jaxpar eval`.

The forward is the model's `logits` (positions, padding mask; no pipeline), jitted
under the plan, its batch split over the plan's batch axes like a training batch.
Packed documents keep attention inside each document (the logits' segment ids) at
its own positions, so each token's loss is the one it has alone; tokens are
weighted as training weights them (a fine-tuning record's completion only):
sum(w x nll) / sum(w). A mixture is evaluated source by source and weighted by
the mixture (`MixtureEvaluator`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.data.holdout import MAX_BATCHES, HeldOut, held_out_batches
from jaxpar.data.stream import DataSpec, held_out
from jaxpar.parallel import lora


def check_evaluable(model_name: str, cfg) -> None:
    """ValueError unless the named model has the `logits` forward evaluation runs: the dense Llama, the MoE
    Llama with experts in every block (Mixtral; see its blocks' `inference`), or DeepSeek-V3 (its own)."""
    from jaxpar.models import MODELS
    from jaxpar.models.deepseek import DeepseekV3
    from jaxpar.models.llama import Llama
    from jaxpar.models.moe import MoeLlama

    kind = MODELS[model_name][0]
    if kind is MoeLlama and cfg.moe_every != 1:
        raise ValueError(f"evaluation (--eval-every, jaxpar eval) of an MoE model needs experts in every block "
                         f"(moe_every=1, as Mixtral); {model_name!r} has moe_every={cfg.moe_every}")
    if kind not in (Llama, MoeLlama, DeepseekV3):
        raise ValueError(f"evaluation (--eval-every, jaxpar eval) supports the Llama, MoE Llama and DeepSeek-V3 "
                         f"models, not {model_name!r}")


def token_losses(model, inputs, targets, positions=None, mask=None, segment_ids=None):
    """Per-token next-token cross-entropy [batch, seq] from the model's logits (at `positions`, `mask`: real tokens,
    `segment_ids`: packed documents, each attending only to itself)."""
    logits = model.logits(inputs, positions, mask, segment_ids)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


class Evaluator:
    """Held-out loss and perplexity of a model's parameters under a plan (compiled once, reused)."""

    def __init__(self, model_def, plan, windows: dict, batch_size: int):
        self.model_def, self.plan, self.batch_size = model_def, plan, batch_size
        self.windows = windows
        sharding = plan.sharding(plan.batch_spec(2))

        def loss_sum(params, batch):
            module = lora.merged(model_def.merge(params))  # the logits forward reads W; LoRA's W + (alpha / r) A B
            losses = token_losses(module, batch["inputs"], batch["targets"], batch.get("positions"), batch.get("mask"),
                                  batch.get("segment_ids"))
            return jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"])

        self._sharding = sharding
        self._fn = jax.jit(loss_sum)

    def __call__(self, params, windows: dict | None = None) -> dict[str, float]:
        """Held-out figures of `params` in natural layer order (jaxpar.pipeline.layer_order): the forward is no pipeline.

        `windows` (default the evaluator's own) of the same fields and row length reuse the compiled forward.
        """
        windows = self.windows if windows is None else windows
        total, count = 0.0, 0.0
        rows = windows["inputs"].shape[0]
        with self.plan.activate():
            for lo in range(0, rows, self.batch_size):
                batch = {k: jax.device_put(v[lo: lo + self.batch_size], self._sharding) for k, v in windows.items()}
                loss, n = self._fn(params, batch)
                total, count = total + float(loss), count + float(n)
        loss = total / count
        return {"eval_loss": loss, "eval_ppl": _ppl(loss), "eval_tokens": int(count)}


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))


class MixtureEvaluator:
    """Held-out figures of each source of a mixture (`eval_loss/<source>`, ...) and `eval_loss`, the sources'
    losses weighted by the mixture's weights: the loss of the data the run trains on, in the shares it trains on it."""

    def __init__(self, model_def, plan, held: list[HeldOut], seq_len: int, batch_size: int,
                 max_batches: int = MAX_BATCHES):
        total = sum(h.weight for h in held)
        self.held = [(h.name, h.weight / total, h.windows(seq_len, batch_size, max_batches)) for h in held]
        self.evaluator = Evaluator(model_def, plan, self.held[0][2], batch_size)

    def __call__(self, params) -> dict[str, float]:
        out, mixed, tokens = {}, 0.0, 0
        for name, weight, windows in self.held:
            figures = self.evaluator(params, windows)
            out.update({f"{key}/{name}": value for key, value in figures.items()})
            mixed, tokens = mixed + weight * figures["eval_loss"], tokens + figures["eval_tokens"]
        return {"eval_loss": mixed, "eval_ppl": _ppl(mixed), "eval_tokens": tokens, **out}


def evaluate_checkpoint(path, plan, data: str | None = None, seq_len: int | None = None, batch_size: int = 8,
                        step: int | None = None, max_batches: int = MAX_BATCHES, tokenizer: str | None = None,
                        packing: str | None = None, skip_bad_records: bool = False) -> dict[str, Any]:
    """`jaxpar eval`: held-out loss and perplexity of a training checkpoint, export or HF directory.

    The data is read as `jaxpar train` reads it (`--tokenizer`, token-file headers, `--packing`), so the held-out
    split is the same (whole documents for a document source) and weighted the same; bad records are refused, or
    left out under `skip_bad_records`, as training does.
    """
    from jaxpar.interop import hf, saved_weights
    from jaxpar.models import model_factory
    from jaxpar.train.state import describe

    name, cfg = hf.saved_model_config(path)
    seq_len = seq_len or min(cfg.seq_len, 256)
    plan.check_batch(batch_size)
    held = held_out(DataSpec(data, tokenizer, packing=packing, skip_bad_records=skip_bad_records), cfg.vocab,
                    batch_size, seq_len)
    mixture = isinstance(held, list)  # each source's own held-out part
    model = describe(model_factory(name, cfg, 0))
    params = saved_weights.load_params(path, model, plan, step)
    evaluator = (MixtureEvaluator(model, plan, held, seq_len, batch_size, max_batches) if mixture
                 else Evaluator(model, plan, held_out_batches(held, seq_len, batch_size, max_batches), batch_size))
    return {"path": str(path), **evaluator(params)}

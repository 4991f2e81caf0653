"""Loss and perplexity on a held-out split: the tail of the token stream, cut into non-overlapping windows.

With evaluation on (`--eval-every N`, or `jaxpar eval` on a run that had it),
training samples its windows from the first (1 - HOLDOUT) of the tokens only, so
the evaluated tail is never trained on. For a document source the cut falls on a
document boundary: the last documents are held out whole, never a document's tail
(which would leak its head into training). The forward is the model's `logits`
(positions, padding mask; no pipeline), jitted under the plan, its batch split
over the plan's batch axes like a training batch.

Under `--packing documents` the held-out documents are packed into rows as training
packs them (`eval_documents`; longer ones in pieces), and the forward keeps attention
inside each document (the logits' segment ids) at its own positions, so each token's
loss is the one it has alone; tokens are weighted as training weights them (a
fine-tuning record's completion only): sum(w x nll) / sum(w).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HOLDOUT = 0.05  # the fraction of the token stream held out for evaluation
MAX_BATCHES = 8  # windows evaluated: at most this many batches of the run's batch size


def check_evaluable(model_name: str, cfg) -> None:
    """ValueError unless the named model has the `logits` forward evaluation runs: the dense Llama, or the MoE
    Llama with experts in every block (Mixtral; see its blocks' `inference`)."""
    from jaxpar.models import MODELS
    from jaxpar.models.llama import Llama
    from jaxpar.models.moe import MoeLlama

    kind = MODELS[model_name][0]
    if kind is MoeLlama and cfg.moe_every != 1:
        raise ValueError(f"evaluation (--eval-every, jaxpar eval) of an MoE model needs experts in every block "
                         f"(moe_every=1, as Mixtral); {model_name!r} has moe_every={cfg.moe_every}")
    if kind not in (Llama, MoeLlama):
        raise ValueError(f"evaluation (--eval-every, jaxpar eval) supports the Llama and MoE Llama models, not "
                         f"{model_name!r}")


def split_tokens(tokens: np.ndarray, holdout: float = HOLDOUT, document_starts: np.ndarray | None = None,
                 source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, held-out tokens): the last `holdout` of the stream is held out.

    With `document_starts` (a document source) the cut moves to the first document
    start at or after that mark, or to the last document's start if it spans the
    mark, so the held-out split is whole documents, the same ones on every run.
    """
    cut = holdout_cut(tokens.size, holdout, document_starts, source)
    return tokens[:cut], tokens[cut:]


def holdout_cut(size: int, holdout: float = HOLDOUT, document_starts: np.ndarray | None = None,
                source: str | None = None) -> int:
    """Where `split_tokens` cuts a stream of `size` tokens (at a document start where they are known)."""
    cut = size - max(1, int(size * holdout))
    if document_starts is not None:
        if len(document_starts) < 2:
            name = "the data" if source is None else f"--data {source!r}"
            raise ValueError(f"{name} holds one document; evaluation holds out whole documents, so it needs at least "
                             "two (split the text into several records) or drop --eval-every")
        later = document_starts[document_starts >= cut]
        cut = int(later[0]) if later.size else int(document_starts[-1])
        cut = max(cut, int(document_starts[1]))  # at least one document is trained on
    return cut


def split_documents(documents, holdout: float = HOLDOUT, source: str | None = None) -> tuple:
    """(training documents, held-out documents) of a `DocumentSource` (`jaxpar.train.block_packing`), both unread:
    the last `holdout` of the documents (at least one), whole; at least one is trained on."""
    count = len(documents)
    if count < 2:
        raise ValueError(f"--data {source!r} holds {count} document: holding out whole documents for evaluation "
                         "needs two or more; add documents or drop --eval-every")
    cut = count - min(count - 1, max(1, int(count * holdout)))
    return documents.view(0, cut), documents.view(cut, count)


def split_stream_document(documents) -> tuple:
    """(training part, held-out part) of a source that is one token stream (a mixture's token file, packed in
    row-size pieces): its tail, as `split_tokens` holds out a token file's tail."""
    from jaxpar.train.block_packing import InMemoryDocuments
    from jaxpar.train.packing import Document

    (stream,) = documents.documents(0, 1)
    cut = holdout_cut(stream.tokens.size)
    return InMemoryDocuments([Document(stream.tokens[:cut])]), InMemoryDocuments([Document(stream.tokens[cut:])])


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """One source's held-out data in a mixture: tokens (windows) or documents (packed), and its mixture weight."""

    name: str
    weight: float
    data: Any  # np.ndarray of tokens, or a DocumentSource

    def windows(self, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
        if isinstance(self.data, np.ndarray):
            return eval_windows(self.data, seq_len, batch_size, max_batches)
        return eval_documents(self.data, seq_len, batch_size, max_batches)


def held_out_streams(streams, vocab: int) -> tuple[list[np.ndarray], list[HeldOut]]:
    """A windows mixture's streams (`training_streams`) each split as one source is: (training tokens, held out)."""
    from jaxpar.train.data import check_vocab

    trained, held = [], []
    for name, tokens, weight, starts in streams:
        train, kept = split_tokens(tokens, document_starts=starts, source=name)
        check_vocab(kept, vocab, name)
        trained.append(train)
        held.append(HeldOut(name, weight, kept))
    return trained, held


def mixture_held_out(data: str, tokenizer: str | None, vocab: int, packing: str, seq_len: int,
                     batch_size: int) -> list[HeldOut]:
    """What `jaxpar train --eval-every` holds out of a mixture, for `jaxpar eval`: each source's own part."""
    from jaxpar.interop.tokenize import training_streams
    from jaxpar.run.packed import packed_mixture

    if packing == "documents":
        return packed_mixture(data, tokenizer, vocab, "text", batch_size, seq_len, 0, holdout=True)[1]
    return held_out_streams(training_streams(data, tokenizer, vocab, "text"), vocab)[1]


def eval_documents(documents, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
    """Held-out documents (a `DocumentSource` or a list, read in blocks until they fill the batches) packed into rows
    (jaxpar.train.packing), as whole batches: inputs, targets, positions, segment_ids (0: padding, and every token
    of a row added to fill a batch), weights (the packer's loss weights)."""
    from jaxpar.train.block_packing import BLOCK_DOCUMENTS, InMemoryDocuments
    from jaxpar.train.packing import as_batch, pack

    if isinstance(documents, list):
        documents = InMemoryDocuments(documents)
    wanted, read, packed = batch_size * max_batches, 0, None
    while read < len(documents) and (packed is None or packed["tokens"].shape[0] <= wanted):
        read = min(len(documents), read + BLOCK_DOCUMENTS)  # next-fit rows of a prefix are the whole's first rows
        packed = pack(documents.documents(0, read), seq_len)
    rows = as_batch(packed)
    count = min(rows["inputs"].shape[0], batch_size * max_batches)
    total = math.ceil(count / batch_size) * batch_size
    out = {name: np.zeros((total, seq_len), value.dtype) for name, value in rows.items()}
    for name, value in rows.items():
        out[name][:count] = value[:count]
    return {"inputs": out["inputs"], "targets": out["targets"], "positions": out["positions"],
            "segment_ids": out["segment_ids"], "weights": out["loss_weights"]}


def eval_windows(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int = MAX_BATCHES) -> dict:
    """Non-overlapping windows of the held-out tokens as whole batches: inputs, targets, weights (0: padding row)."""
    count = (tokens.size - 1) // seq_len
    if count < 1:
        raise ValueError(f"the held-out split has {tokens.size} tokens, fewer than one window of seq_len+1={seq_len + 1}")
    count = min(count, batch_size * max_batches)
    rows = math.ceil(count / batch_size) * batch_size
    windows = np.zeros((rows, seq_len + 1), np.int32)
    for i in range(count):
        windows[i] = tokens[i * seq_len: i * seq_len + seq_len + 1]
    weights = (np.arange(rows) < count).astype(np.float32)[:, None].repeat(seq_len, axis=1)
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "weights": weights}


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
            module = model_def.merge(params)
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

    def __init__(self, model_def, plan, held: list[HeldOut], seq_len: int, batch_size: int):
        self.held = [(h.name, h.weight / sum(x.weight for x in held), h.windows(seq_len, batch_size)) for h in held]
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
                        packing: str | None = None) -> dict[str, Any]:
    """`jaxpar eval`: held-out loss and perplexity of a training checkpoint, export or HF directory.

    The data is read as `jaxpar train` reads it (`--tokenizer`, token-file headers, `--packing`), so the held-out
    split is the same (whole documents for a document source) and weighted the same.
    """
    from jaxpar.interop import hf
    from jaxpar.interop.tokenize import training_source
    from jaxpar.models import model_factory
    from jaxpar.run.packed import documents_of, packing_of
    from jaxpar.train.sources import parse_sources
    from jaxpar.train.state import describe

    name, cfg = hf.saved_model_config(path)
    seq_len = seq_len or min(cfg.seq_len, 256)
    packing = packing_of(data, packing)
    mixture = data is not None and len(parse_sources(data)) > 1
    if mixture:
        held = mixture_held_out(data, tokenizer, cfg.vocab, packing, seq_len, batch_size)
    elif packing == "documents":
        _, documents = split_documents(documents_of(data, tokenizer, cfg.vocab), source=data)
        windows = eval_documents(documents, seq_len, batch_size, max_batches)
    else:
        tokens, document_starts = training_source(data, tokenizer, cfg.vocab)
        _, heldout = split_tokens(tokens, document_starts=document_starts, source=data)
        windows = eval_windows(heldout, seq_len, batch_size, max_batches)
    plan.check_batch(batch_size)
    model = describe(model_factory(name, cfg, 0))
    params = hf.load_params(path, model, plan, step)
    evaluator = (MixtureEvaluator(model, plan, held, seq_len, batch_size) if mixture
                 else Evaluator(model, plan, windows, batch_size))
    return {"path": str(path), **evaluator(params)}

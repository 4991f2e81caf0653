"""What a model used while its step was traced, so that a plan option that acted on nothing is refused or warned about.

jaxpar's layers call `mark` when they run under a plan: the tensor-parallel
layers (`TENSOR`), the MoE layer (`EXPERTS`), the stacked-layer block
(`STACK`), the pipeline (`PIPELINE`) and the three parts of context
parallelism (`CONTEXT_PARTS`). The step traces the model inside
`recording()` and then calls `check`, which raises where an option would make
the result wrong or wasteful (`pipe > 1` with no pipeline: every pipe rank
repeats the whole model) and warns where it merely does nothing. All of this
runs while tracing, before anything compiles.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
from jax.sharding import PartitionSpec

from jaxpar.core import trace
from jaxpar.core import zero_layout as zero_lib

TENSOR = "tensor"  # a Megatron layer split its weights over tensor axes (jaxpar.parallel.tensor)
EXPERTS = "experts"  # an MoE layer dispatched tokens to experts (jaxpar.parallel.experts.moe_ffn)
STACK = "stack"  # a stacked-layer block ran its scan (applies the remat policy and ZeRO per-layer gathers)
PIPELINE = "pipeline"  # the model's layers ran as pipeline stages over `pipe`
LOSS_CHUNKS = "loss chunks"  # the cross-entropy ran over chunks of tokens (jaxpar.parallel.loss_chunks)
TENSOR_PARAMS = "tensor params"  # a parameter is sharded over tensor (by its logical names or a Megatron layer)
# Context parallelism (jaxpar.parallel.attention): the three places that must agree on the load-balanced sequence order.
CONTEXT_ATTENTION = "context attention"  # jaxpar's causal attention ran split over context
CONTEXT_TOKENS = "context tokens"  # jaxpar's embedding lookup put the tokens in context order
CONTEXT_TARGETS = "context targets"  # jaxpar's loss put the targets in context order
CONTEXT_PARTS = {
    CONTEXT_ATTENTION: "causal attention (jaxpar.parallel.attention.causal_attention)",
    CONTEXT_TOKENS: "embedding lookup (jaxpar.embedding_lookup)",
    CONTEXT_TARGETS: "loss (jaxpar.vocab_parallel_cross_entropy)",
}

EXPLICIT_UNUSED = (
    "tensor_form='explicit' runs the model once per tensor rank, which only jaxpar's tensor-parallel layers "
    "(jaxpar.parallel.tensor) can do, and the model ran none: its other operations see one rank's shard of every "
    "array split over tensor, or repeat the whole work on every rank. Use tensor_form='annotation'"
)

class PlanOptionUnused(UserWarning):
    """A plan option that changes nothing for this model."""


def mark_tensor_params(specs) -> None:
    """Mark TENSOR_PARAMS if any PartitionSpec in `specs` (the parameters') shards over tensor."""
    for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
        if any(entry == "tensor" or (isinstance(entry, tuple) and "tensor" in entry) for entry in spec):
            mark(TENSOR_PARAMS)
            return


def mark(feature: str) -> None:
    """Note that the model being traced used `feature` (one of the names above); a no-op outside `recording`."""
    record = trace.current().used
    if record is not None:
        record.add(feature)


def mark_choice(prefix: str, name: str, why: str) -> str:
    """Note a kernel choice (`prefix` names the kind: attention's, the MoE experts') with its reason; return `name`."""
    mark(f"{prefix}{name} ({why})")
    return name


def marked_choices(used: set[str], prefix: str) -> list[str]:
    """Every distinct choice of kind `prefix` marked while a step was traced, as "name (why)"."""
    return sorted(mark[len(prefix):] for mark in used if mark.startswith(prefix))


@contextlib.contextmanager
def recording():
    """Collect the features marked while the body runs (traces the model) into the yielded set."""
    record: set[str] = set()
    with trace.scoped(used=record):
        yield record


def problems(plan, used: set[str]) -> tuple[list[str], list[str]]:
    """(errors, warnings): the options of `plan` that could not act on a model that used `used`."""
    shape = plan.shape
    errors, notes = [], []
    if shape["pipe"] > 1 and PIPELINE not in used:
        errors.append(
            f"pipe={shape['pipe']} but the model ran no pipeline: every pipe rank would repeat the whole model. "
            f"Run the repeated layers through jaxpar's stacked-layer block with the pipeline, or drop pipe from "
            f"the mesh (e.g. give those devices to data)"
        )
    if TENSOR not in used:
        if plan.tensor_form == "explicit" and shape["tensor"] > 1:
            errors.append(EXPLICIT_UNUSED)
        elif plan.tensor_form == "explicit":
            notes.append("tensor_form='explicit' has no effect: the model ran no tensor-parallel layer "
                         "(jaxpar.parallel.tensor) splitting weights over tensor")
        if (plan.tensor_form == "annotation" and shape["tensor"] > 1 and TENSOR_PARAMS not in used
                and "tensor" not in plan.batch_axes):
            notes.append(
                f"tensor={shape['tensor']} splits nothing: no parameter has a logical name the rules map to tensor "
                f"and the model ran no tensor-parallel layer, so every tensor rank repeats the whole model. Name "
                f"the weights' dimensions (e.g. 'mlp', 'heads') or give those devices to data"
            )
        if plan.sequence_parallel:
            notes.append("sequence_parallel=True has no effect: the model ran no tensor-parallel layer "
                         "(jaxpar.parallel.tensor) splitting weights over tensor")
    if shape["expert"] > 1 and EXPERTS not in used:
        notes.append(f"expert={shape['expert']} acts as more data parallelism: the model ran no MoE layer "
                     f"(jaxpar.parallel.experts.moe_ffn)")
    context_errors, context_notes = _context_problems(plan, used)
    errors, notes = errors + context_errors, notes + context_notes
    if zero_lib.no_effect_message(plan):
        notes.append(zero_lib.no_effect_message(plan))
    if plan.loss_chunks and LOSS_CHUNKS not in used:
        notes.append(f"loss_chunks={plan.loss_chunks} has no effect: the model computed no [batch, seq] loss with "
                     f"jaxpar.vocab_parallel_cross_entropy")
    if plan.remat != "none" and STACK not in used:
        notes.append(f"remat={plan.remat!r} has no effect: the model ran no stacked-layer block for it to wrap")
    return errors, notes


def _context_problems(plan, used: set[str]) -> tuple[list[str], list[str]]:
    """Context parallelism needs jaxpar's embedding, attention and loss together: each alone computes wrong results.

    The embedding and the loss reorder the sequence for load balancing and
    attention derives its positions from that order; a model whose own layer
    stands in for one of them would mix two orders.
    """
    ways = plan.shape["context"]
    if ways == 1:
        form = [f"context_form={plan.context_form!r} has no effect: the context axis has size 1"] \
            if plan.context_form != "all-gather" else []
        return [], form
    ran = [part for part in CONTEXT_PARTS if part in used]
    if not ran:
        return [], [f"context={ways} splits the sequence of the model's activations, but the model ran none of "
                    f"jaxpar's context-parallel layers (jaxpar.parallel.attention.causal_attention, embedding_lookup, "
                    f"vocab_parallel_cross_entropy): the compiler gathers the sequence wherever the model mixes "
                    f"positions, so attention memory does not fall"]
    missing = [text for part, text in CONTEXT_PARTS.items() if part not in ran]
    if missing:
        return [f"context={ways} needs jaxpar's embedding lookup, causal attention and loss together (they agree "
                f"on a load-balanced order of the sequence), but the model ran its own {', '.join(missing)}: its "
                f"results would be wrong. Use jaxpar's, or drop context from the mesh"], []
    return [], []


@contextlib.contextmanager
def explained(plan):
    """Record usage while tracing the body; an error raised there under an option the model cannot use says so."""
    with recording() as used:
        try:
            yield used
        except ValueError:
            raise  # jaxpar's own checks say what is wrong themselves
        except Exception as error:
            if plan.tensor_form == "explicit" and plan.shape["tensor"] > 1 and TENSOR not in used:
                raise ValueError(EXPLICIT_UNUSED) from error
            raise


def check(plan, used: set[str]) -> None:
    """Raise ValueError for the options of `plan` that would be wrong or wasteful; warn for those that do nothing."""
    errors, notes = problems(plan, used)
    if errors:
        raise ValueError("\n".join(errors))
    for note in notes:
        warnings.warn(note, PlanOptionUnused, stacklevel=3)

"""Which implementation each call of causal attention gets, and why.

`Plan.attention` asks for one: `auto` (the default), `xla` (the textbook masked
softmax, which keeps [seq, seq] scores for the backward), `flash` (blockwise in
XLA, `jaxpar.parallel.attention_flash`), `cudnn` (NVIDIA's fused kernel
through `jax.nn.dot_product_attention`), `pallas` (jaxpar's Pallas flash
kernel for NVIDIA GPUs, `jaxpar.parallel.attention_pallas`) or `splash`
(JAX's splash attention kernel for TPUs, `jaxpar.parallel.attention_splash`).
`auto` takes, on NVIDIA, cuDNN where it can run the call exactly and every
mesh axis splits its batch or heads (the call runs per shard, `parallel/attention.py`'s `_cudnn`), else flash
(the Pallas kernel, tested in Pallas' interpreter only, is taken when asked
for until it has run on a GPU); on TPU splash where it can, else flash; flash
everywhere else. A forced choice the call rules out is
refused with the reason, while tracing, before anything compiles; a forced cuDNN
that no call of the plan could get (not NVIDIA, fp32, context parallelism) is
refused before the model is built (`check_forced`). The device is the plan's
(`jaxpar.core.device_facts`: a compile-only GPU target's too), never the process's.

`interpreted()` runs the Pallas and splash kernels through Pallas' interpreter,
on any backend: forced `pallas` or `splash` on a CPU is refused outside it
(the interpreter is for tests and debugging, far slower than flash), and
`auto` never picks them there.

cuDNN is never given what it cannot honour: packed documents' segment ids (a
fused path that dropped them trained on the wrong loss in MaxText #4476), a
logit soft cap, fp32, a value head dimension unlike the query's, or the
reordered sequence of context parallelism; no fused kernel is given attention sinks (gpt-oss). Each call's choice is marked in the
trace (`jaxpar.core.usage`) so that `jaxpar inspect` and the run's header say
what the attention got.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.core import device_facts, options, target, usage
from jaxpar.core.trace import active_plan
from jaxpar.parallel import attention_pallas, attention_splash
from jaxpar.parallel.attention_flash import Blocks, default_blocks
from jaxpar.parallel.attention_math import Scoring

IMPLEMENTATIONS = ("auto", "xla", "flash", "cudnn", "pallas", "splash")
options.register_choices("attention", IMPLEMENTATIONS)
MARK = "attention: "  # the prefix of the usage marks that record each call's choice
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
SINKS_REFUSAL = "attention sinks: the fused kernels' softmax has no sink logit in its denominator"
CUDNN_MAX_HEAD_DIM = 128  # the head dimensions jax.nn.dot_product_attention's cuDNN path takes: <= 128, multiple of 8


@dataclasses.dataclass(frozen=True)
class Call:
    """What decides which implementation can run one attention call."""

    dtype: jnp.dtype
    head_dim: int
    value_dim: int
    segments: bool
    scoring: Scoring
    context_ways: int
    sinks: bool = False
    whole_on: tuple[str, ...] = ()  # mesh axes > 1 that split neither batch nor heads: a fused call runs whole there


def cudnn_refusal(call: Call, device_kind: str | None = None) -> str | None:
    """Why cuDNN cannot run `call` exactly on a device of `device_kind` (default: the plan's), or None."""
    device_kind = device_kind or device_facts.current().kind
    if not device_kind.startswith("NVIDIA"):
        return f"the device is {device_kind}: cuDNN runs on NVIDIA GPUs"
    if call.segments:
        return "the rows are packed documents: jax.nn.dot_product_attention's cuDNN path takes no segment ids"
    if call.scoring.softcap is not None:
        return "a logit soft cap: cuDNN's fused softmax has none"
    if call.context_ways > 1:
        return "context parallelism: each rank's queries and keys are non-contiguous chunks of the sequence"
    if jnp.dtype(call.dtype) not in [jnp.dtype(t) for t in CUDNN_DTYPES]:
        return f"dtype {jnp.dtype(call.dtype).name}: cuDNN flash attention runs bf16 or fp16"
    if call.value_dim != call.head_dim:
        return f"value head dimension {call.value_dim} differs from the query/key head dimension {call.head_dim}"
    if call.head_dim > CUDNN_MAX_HEAD_DIM or call.head_dim % 8:
        return f"head dimension {call.head_dim}: cuDNN takes multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


_INTERPRET = contextvars.ContextVar("jaxpar_attention_interpret", default=False)


@contextlib.contextmanager
def interpreted():
    """Within it, the Pallas and splash kernels run in Pallas' interpreter (any backend, forced choices only)."""
    token = _INTERPRET.set(True)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpreting() -> bool:
    return _INTERPRET.get()


KERNELS = {"pallas": attention_pallas.pallas_refusal, "splash": attention_splash.splash_refusal}


def choose(call: Call, device_kind: str | None = None) -> tuple[str, str]:
    """(implementation, why) for `call` under the active plan's `attention` (auto outside a plan).

    Raises ValueError when the plan forces an implementation the call or the backend rules out.
    """
    plan = active_plan()
    asked = "auto" if plan is None else plan.attention
    if asked == "xla":
        return "xla", "asked for (attention=xla): plain masked softmax, [seq, seq] scores kept for the backward"
    if asked == "flash":
        return "flash", "asked for (attention=flash)"
    if call.sinks:  # no fused kernel adds a logit to its softmax's denominator
        if asked != "auto":
            raise ValueError(f"attention={asked!r} cannot run this attention: {SINKS_REFUSAL}. Use attention='auto' "
                             f"or 'flash'")
        return "flash", f"auto: no fused kernel applies ({SINKS_REFUSAL})"
    device_kind = device_kind or device_facts.current().kind
    if asked in KERNELS:
        refusal = KERNELS[asked](call, device_kind, plan_blocks(), interpreting())
        if refusal:
            hint = " (jaxpar.parallel.attention_kernels.interpreted() runs it in Pallas' interpreter, for tests)" \
                if refusal.startswith("the device") else ""
            raise ValueError(f"attention={asked!r} cannot run this attention: {refusal}{hint}. Use "
                             f"attention='auto' or 'flash'")
        return asked, f"asked for (attention={asked})" + (", in Pallas' interpreter" if interpreting() else "")
    refusal = cudnn_refusal(call, device_kind)
    facts = device_facts.current()
    if refusal is None and facts.target and not facts.cudnn:
        refusal = f"cuDNN is not installed here for the target's compile ({target.CUDNN_INSTALL})"
    if asked == "cudnn":
        if refusal:
            raise ValueError(f"attention='cudnn' cannot run this attention: {refusal}. Use attention='auto' "
                             f"(flash attention where cuDNN does not apply) or 'flash'")
        return "cudnn", "asked for (attention=cudnn)"
    if refusal is None and call.whole_on:
        refusal = (f"the mesh axes {', '.join(call.whole_on)} split neither the batch nor the heads: each of their "
                   f"ranks would run the whole call")
    if refusal is None:
        return "cudnn", "auto: NVIDIA GPU, causal" + (" sliding-window" if call.scoring.window else "") + \
            f" attention in {jnp.dtype(call.dtype).name}"
    if device_kind.startswith("NVIDIA"):
        # jaxpar's Pallas kernel has run only in Pallas' interpreter: until a GPU has compiled it and matched the
        # reference with it, auto keeps to flash attention in XLA, and attention=pallas asks for the kernel
        return "flash", f"auto: cuDNN does not apply ({refusal}); the Pallas kernel is taken only when asked for " \
                        f"(attention=pallas) until it has run on a GPU"
    if device_kind.startswith("TPU"):
        splash = attention_splash.splash_refusal(call, device_kind)
        if splash is None:
            return "splash", "auto: TPU, splash attention"
        return "flash", f"auto: splash attention does not apply ({splash})"
    return "flash", f"auto: no fused kernel on {device_kind} (cuDNN and Pallas run on NVIDIA GPUs, splash on TPUs)"


def check_forced(plan) -> None:
    """Raise ValueError, before anything is traced, when the plan forces cuDNN where no call could get it: the
    plan's devices are not NVIDIA GPUs, its precision computes attention in fp32, or context parallelism reorders
    the sequence. What depends on the model (head sizes, soft caps, packed documents) is refused while tracing."""
    if plan.attention != "cudnn":
        return
    facts = device_facts.of_mesh(plan.mesh)
    kind = facts.kind if facts.kind == facts.backend else f"{facts.kind} ({facts.backend})"
    if not facts.nvidia:
        why = f"the plan's devices are {kind}: cuDNN runs on NVIDIA GPUs"
    elif plan.precision == "fp32":
        why = "precision='fp32' computes attention in fp32: cuDNN flash attention runs bf16 or fp16"
    elif facts.target and not facts.cudnn:
        why = f"cuDNN is not installed here for the target's compile ({target.CUDNN_INSTALL})"
    else:
        why = cudnn_refusal(Call(jnp.bfloat16, 8, 8, False, Scoring(), plan.shape["context"]), facts.kind)
    if why:
        raise ValueError(f"attention='cudnn' cannot run on this plan: {why}. Use attention='auto' (flash attention "
                         f"where cuDNN does not apply) or 'flash'")


def chosen(call: Call) -> str:
    """The implementation for `call`, its choice marked in the trace."""
    return usage.mark_choice(MARK, *choose(call))


def choices(used: set[str]) -> list[str]:
    """Every distinct choice marked while a step was traced, e.g. ['flash (auto: cuDNN does not apply (...))']."""
    return usage.marked_choices(used, MARK)


def blocks() -> Blocks:
    """Flash attention's block lengths: the plan's `attention_blocks` ("Q,K" or "N"), or the backend's."""
    return plan_blocks() or default_blocks()


def kernel_blocks(name: str) -> Blocks | None:
    """The Pallas or splash kernel's blocks: the plan's `attention_blocks` when it forces that kernel, else its
    own (under auto the plan's blocks are flash attention's)."""
    plan = active_plan()
    return plan_blocks() if plan is not None and plan.attention == name else None


def plan_blocks() -> Blocks | None:
    """The plan's `attention_blocks`, or None where it sets none (each kernel then takes its own)."""
    plan = active_plan()
    text = "" if plan is None else plan.attention_blocks
    return parse_blocks(text) if text else None


def parse_blocks(text: str) -> Blocks:
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) not in (1, 2) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"attention_blocks must be 'Q,K' or 'N' with positive integers (flash attention's query "
                         f"and key block lengths), got {text!r}")
    return Blocks(int(parts[0]), int(parts[-1]))


@options.register_plan_check
def _check_blocks(plan) -> None:
    if plan.attention_blocks:
        parse_blocks(plan.attention_blocks)
        if plan.attention in ("xla", "cudnn"):
            raise ValueError(f"attention_blocks={plan.attention_blocks!r} sets flash attention's blocks, but "
                             f"attention={plan.attention!r} runs no flash attention; drop one of them")
        kernel = {"pallas": attention_pallas, "splash": attention_splash}.get(plan.attention)
        refusal = kernel and kernel.block_refusal(parse_blocks(plan.attention_blocks))
        if refusal:
            raise ValueError(f"attention_blocks={plan.attention_blocks!r} with attention={plan.attention!r}: "
                             f"{refusal}")


def fused(name: str, q, k, v, scoring: Scoring, segments=None):
    """The Pallas (name 'pallas') or splash ('splash') kernel on q [b, s, heads, d], k and v [b, s, kv_heads, *]."""
    run = attention_pallas.pallas_attention if name == "pallas" else attention_splash.splash_attention
    return run(q, k, v, scoring, segments, kernel_blocks(name), interpreting())


def cudnn(q, k, v, scoring: Scoring):
    """NVIDIA's fused causal attention; q [b, s, heads, d], k and v [b, s, kv_heads, d] (grouped-query as is)."""
    window = None if scoring.window is None else (scoring.window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scoring.scale, is_causal=True, local_window_size=window,
                                        implementation="cudnn")

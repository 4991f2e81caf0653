"""A candidate layout (mesh sizes and plan options), the batch it runs, and what jaxpar derives from the two.

The derived figures are the ones several parts of the model need alike: the
sequences and positions one device holds, the remat policy a block really runs
under, and whether ZeRO looks the tokens up in the embedding's shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jaxpar.core import mesh as mesh_lib
from jaxpar.core import zero_layout
from jaxpar.planner.model import Model

AXES = mesh_lib.AXES  # `Layout` has a size field for each, outermost (across hosts) first, as jaxpar.core.mesh nests them
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")  # the pipeline schedules the planner counts (all the executor's)
REMATS = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-params")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16-params": 2}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A candidate layout: mesh axis sizes plus the plan options that change memory, traffic or time."""

    data: int = 1
    tensor: int = 1
    pipe: int = 1
    expert: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 0  # pipeline microbatches per step (0: one per stage)
    virtual_stages: int = 1
    grad_accum: int = 1
    remat: str = "none"
    precision: str = "bf16"
    sequence_parallel: bool = False
    tensor_form: str = "annotation"
    context: int = 1  # context parallelism: the sequence split over `context` (jaxpar.parallel.attention)
    context_form: str = "all-gather"
    attention: str = "auto"  # jaxpar.parallel.attention_kernels: only xla keeps [seq, seq] scores
    offload: str = "none"  # "optimizer": the optimizer state (and fp32 master) in host memory (jaxpar.parallel.offload)
    replica: int = 1  # HSDP: replicas of the ZeRO group over `data` (jaxpar.core.plan zero_axes = data)
    moe_kernel: str = "auto"  # jaxpar.parallel.expert_kernels: the form the planner counted a MoE layer in
    moe_exchange: str = "buffers"  # over `expert`: "ragged" where the backend has ragged-all-to-all (no option)

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh axis {axis} must be >= 1, got {getattr(self, axis)}")
        choices = {"zero": (0, 1, 2, 3), "schedule": SCHEDULES, "remat": REMATS, "precision": PRECISIONS,
                   "tensor_form": ("annotation", "explicit"), "context_form": ("all-gather", "ring"),
                   "attention": ("auto", "xla", "flash", "cudnn", "pallas", "splash"),
                   "offload": ("none", "optimizer"), "moe_kernel": ("auto", "buffered", "tiled", "ragged"),
                   "moe_exchange": ("buffers", "ragged")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.microbatches == 0:
            object.__setattr__(self, "microbatches", self.pipe)
        if self.pipe == 1:
            object.__setattr__(self, "schedule", "1f1b")

    @functools.cached_property
    def shape(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.shape.values())

    @property
    def mesh(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.shape.items() if n > 1) or "data=1"

    def options(self) -> dict[str, Any]:
        """The `jaxpar.core.plan.Plan` options of this layout (defaults left out)."""
        default = Layout()
        names = ("zero", "schedule", "microbatches", "virtual_stages", "grad_accum", "remat", "precision",
                 "sequence_parallel", "tensor_form", "context_form", "attention", "offload", "moe_kernel")
        out = {n: getattr(self, n) for n in names if getattr(self, n) != getattr(default, n)}
        if self.context == 1:
            out.pop("context_form", None)
        if self.pipe == 1:
            out.pop("schedule", None)
            out.pop("microbatches", None)
        elif self.microbatches != self.pipe:
            out["microbatches"] = self.microbatches
        if self.precision != "fp32":
            out["precision"] = self.precision
        return out

    def __str__(self) -> str:
        return self.label()

    def label(self, precision: bool = True) -> str:
        """`mesh options`, readable back by `Layout.parse` (with the precision)."""
        opts = self.options()
        opts.setdefault("zero", self.zero)
        opts.setdefault("remat", self.remat)
        if not precision:
            opts.pop("precision", None)
        return self.mesh + " " + " ".join(f"{k}={_fmt(v)}" for k, v in opts.items())

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """`data=8,tensor=8,pipe=16 zero=1 schedule=1f1b microbatches=32 remat=full` (spaces or commas)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for part in text.replace(",", " ").split():
            key, sep, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in fields:
                raise ValueError(f"cannot read {part!r} in layout {text!r}; use name=value with names "
                                 f"{', '.join(fields)}")
            kind = type(fields[key].default)
            if kind is bool:
                values[key] = value.lower() in ("1", "true", "yes", "on")
            elif kind is int:
                try:
                    values[key] = int(value)
                except ValueError:
                    raise ValueError(f"layout {key} needs an integer, got {value!r}") from None
            else:
                values[key] = value
        return cls(**values)


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The global batch of one optimizer step."""

    batch_size: int  # sequences
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def microbatch_sequences(layout: Layout, work: Workload) -> int:
    """Sequences in one microbatch on one device (the batch over data x expert, accumulation, microbatches)."""
    ways = layout.replica * layout.data * layout.expert * layout.grad_accum * layout.microbatches
    return work.batch_size // ways


def local_seq(layout: Layout, work: Workload) -> int:
    """Positions of a sequence on one device: context parallelism splits them over `context`."""
    return work.seq_len // layout.context


def remat_policy(layout: Layout, model: Model | None = None) -> str:
    """The checkpoint policy a block really runs under (jaxpar.parallel.stack.remat_wrapper): ZeRO-3, and LoRA on a
    frozen base (`model`), turn `none` into saving every matmul output (`dots`), so the gathered or folded weights
    themselves are never kept."""
    if layout.remat == "none" and ((layout.zero == 3 and layout.data > 1) or (model is not None and model.frozen)):
        return "dots"
    return layout.remat


def sharded_lookup(model: Model, layout: Layout, work: Workload) -> bool:
    """Whether ZeRO-2/3 look the tokens up in each data rank's rows of the embedding table
    (jaxpar.parallel.tensor.embedding_lookup) instead of gathering it: ZeRO splits the table along the vocabulary
    (its larger dimension, dividing by data), no tensor axis splits it, and that moves fewer bytes than the
    gather (`zero_layout.table_gather_is_cheaper`, the rule the lookup itself applies)."""
    v, d, n = model.vocab, model.d_model, layout.data
    if not (layout.zero >= 2 and n > 1 and layout.tensor == 1 and v % n == 0 and (v >= d or d % n)):
        return False
    rows = microbatch_sequences(layout, work) * local_seq(layout, work)
    width = 4 if layout.precision == "fp32" else 2
    return not zero_layout.table_gather_is_cheaper(v, d, n, rows, width)

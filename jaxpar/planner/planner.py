"""The analytic planner: memory, traffic, bubble, FLOPs and step time of a layout, without compiling.

For a model (its parameters' shapes and logical names), a global batch and a
layout (mesh sizes plus the plan options), everything is counted per device
and per step, in the same units `jaxpar.planner.inspect` reads back from XLA:

- model state (ZeRO, Rajbhandari et al. 2020, Table 1): P bytes per parameter
  held, G per gradient, K per optimizer entry; ZeRO-1 divides the K bytes by
  the data size N, ZeRO-2 also the G bytes, ZeRO-3 also the P bytes. Tensor,
  pipe and expert sharding divide each parameter by the mesh axes the plan's
  rules give it (exactly as `jaxpar.core.rules` and `jaxpar.parallel.zero` shard it).
- activations (Korthikanti et al. 2022): per layer and token, the values a
  block keeps for its backward pass by remat policy, divided by t where
  tensor parallelism (and sequence parallelism) splits them, times the layers a
  stage holds and the microbatches a pipeline schedule keeps in flight.
- collectives per step and mesh axis as (kind, bytes, calls), turned into
  ring traffic by `jaxpar.planner.inspect.ring_traffic` (2(n-1)/n S for an all-reduce,
  (n-1)/n S for a gather, scatter or all-to-all, S for a permute).
- bubble (p-1)/(v m + p-1) of the tick tables (jaxpar.pipeline.schedule), FLOPs
  6 N tokens + 12 L s (h hd) tokens for attention, plus the recomputation.

A device spec (jaxpar.planner.devices) turns these into time: compute at a share of
peak, stretched by the bubble; tensor, expert and pipe traffic on the critical
path; data-parallel traffic hidden behind the backward pass where the ZeRO
stage lets it overlap. `plan` enumerates layouts, drops those that do not fit
(with the reason) and ranks the rest by step time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

from jaxpar.core import mesh as mesh_lib
from jaxpar.core import rules as rules_lib
from jaxpar.pipeline import schedule as schedule_lib
from jaxpar.planner.devices import Device, load_device
from jaxpar.planner.inspect import ring_traffic

AXES = mesh_lib.AXES  # `Layout` has a size field for each, outermost (across hosts) first, as jaxpar.core.mesh nests them
SCHEDULES = ("gpipe", "1f1b", "interleaved")
REMATS = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-params")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16-params": 2}


# -- what is being trained -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter array: its shape and logical names (stacked: leading `layers` axis)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return self.names[:1] == ("layers",)


@dataclasses.dataclass(frozen=True)
class Model:
    """The shapes the planner needs: the parameter inventory and the transformer's dimensions."""

    name: str
    leaves: tuple[Leaf, ...]
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int  # padded (the embedding's rows)
    n_experts: int = 0
    top_k: int = 0
    moe_every: int = 1
    expert_d_ff: int = 0
    capacity_factor: float = 1.0
    dropless: bool = False
    group_size: int | None = None

    @functools.cached_property
    def params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)

    @property
    def moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.n_experts else 0

    @property
    def scan_depth(self) -> int:
        """The stacked leading dimension: layers (dense) or groups of moe_every blocks (MoE)."""
        return self.n_layers // self.moe_every if self.n_experts else self.n_layers

    @functools.cached_property
    def separate_head(self) -> bool:
        """Whether the output layer has its own weight (not tied to the embedding table)."""
        return any(leaf.path.endswith("head") for leaf in self.leaves)

    @functools.cached_property
    def flop_params(self) -> int:
        """Parameters a token's forward multiplies with (2 FLOPs each): all but the embedding table and
        the experts a token does not visit."""
        n = self.params
        if self.separate_head:
            n -= self.vocab * self.d_model  # the embedding lookup is no matmul (tied: the table is the head)
        if self.n_experts:
            per_expert = 3 * self.d_model * self.expert_d_ff
            n -= self.moe_layers * (self.n_experts - self.top_k) * per_expert
        return n

    @classmethod
    def named(cls, name: str, overrides: dict | None = None) -> "Model":
        """A model from the registry (jaxpar.models), its inventory counted from the config (no tracing)."""
        from jaxpar.models import model_config

        config = model_config(name, overrides)
        return cls.from_config(name, config, llama_leaves(config))

    @classmethod
    def from_config(cls, name: str, config, leaves: tuple[Leaf, ...]) -> "Model":
        """From a Llama-style config (jaxpar.models) and its parameters (`llama_leaves`, or `leaves_of`)."""
        moe = {}
        if getattr(config, "n_experts", 0):
            moe = dict(n_experts=config.n_experts, top_k=config.top_k, moe_every=config.moe_every,
                       expert_d_ff=config.expert_d_ff, capacity_factor=config.capacity_factor,
                       dropless=config.dropless, group_size=config.group_size)
        return cls(name, tuple(leaves), config.d_model, config.n_layers, config.n_heads, config.n_kv_heads,
                   config.head_dim, config.d_ff, config.padded_vocab, **moe)


def llama_leaves(c) -> tuple[Leaf, ...]:
    """The parameters of jaxpar.models.llama (and its MoE variant), shapes and logical names, from the config."""
    d, h, kv, hd, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.padded_vocab

    def blocks(prefix: str, n: int, dense_ffn: bool = True) -> list[Leaf]:
        out = [
            Leaf(prefix + "attn_norm", (n, d), ("layers", "norm")),
            Leaf(prefix + "wq", (n, d, h, hd), ("layers", "embed", "heads", "head_dim")),
            Leaf(prefix + "wk", (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            Leaf(prefix + "wv", (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            Leaf(prefix + "wo", (n, h, hd, d), ("layers", "heads", "head_dim", "embed")),
            Leaf(prefix + "mlp_norm", (n, d), ("layers", "norm")),
        ]
        if dense_ffn:
            out += [Leaf(prefix + "w_gate", (n, d, f), ("layers", "embed", "mlp")),
                    Leaf(prefix + "w_up", (n, d, f), ("layers", "embed", "mlp")),
                    Leaf(prefix + "w_down", (n, f, d), ("layers", "mlp", "embed"))]
        return out

    leaves = [Leaf("embedding", (v, d), ("vocab", "embed"))]
    if getattr(c, "n_experts", 0):
        groups, e, fe = c.n_layers // c.moe_every, c.n_experts, c.expert_d_ff
        if c.moe_every > 1:
            leaves += blocks("blocks.dense.", groups * (c.moe_every - 1))
        leaves += blocks("blocks.moe.", groups, dense_ffn=False)
        leaves += [Leaf("blocks.moe.router", (groups, d, e), ("layers", "embed", None)),
                   Leaf("blocks.moe.expert_gate", (groups, e, d, fe), ("layers", "experts", "embed", "expert_mlp")),
                   Leaf("blocks.moe.expert_up", (groups, e, d, fe), ("layers", "experts", "embed", "expert_mlp")),
                   Leaf("blocks.moe.expert_down", (groups, e, fe, d), ("layers", "experts", "expert_mlp", "embed"))]
    else:
        leaves += blocks("blocks.", c.n_layers)
    leaves.append(Leaf("final_norm", (d,), ("norm",)))
    if not c.tie_embeddings:
        leaves.append(Leaf("head", (d, v), ("embed", "vocab")))
    return tuple(leaves)


def leaves_of(logical) -> tuple[Leaf, ...]:
    """The parameters of any model from its tree of `jaxpar.train.state.LogicalArray` (jaxpar.train.state.describe)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: hasattr(x, "names"))[0]
    return tuple(Leaf(jax.tree_util.keystr(p), tuple(a.shape), tuple(a.names)) for p, a in flat)


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
    offload: str = "none"  # "optimizer": the optimizer state (and fp32 master) in host memory (jaxpar.parallel.offload)
    replica: int = 1  # HSDP: replicas of the ZeRO group over `data` (jaxpar.core.plan zero_axes = data)

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh axis {axis} must be >= 1, got {getattr(self, axis)}")
        choices = {"zero": (0, 1, 2, 3), "schedule": SCHEDULES, "remat": REMATS, "precision": PRECISIONS,
                   "tensor_form": ("annotation", "explicit"), "context_form": ("all-gather", "ring"),
                   "offload": ("none", "optimizer")}
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
                 "sequence_parallel", "tensor_form", "context_form", "offload")
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


# -- memory -----------------------------------------------------------------------------


def state_bytes_per_param(precision: str, zero: int = 0) -> tuple[int, int, int]:
    """(P, G, K): bytes per parameter of the parameters, gradients and AdamW state (ZeRO's notation).

    fp32: 4 + 4 + 8 (two moments). bf16/fp16 at ZeRO-0/2/3 hold fp32 parameters,
    compute with 2-byte casts and sum the gradients in 2 bytes (jaxpar.train.precision):
    4 + 2 + 8. Under ZeRO-1 they hold the paper's 2 + 2 + 12: the 2-byte
    parameters whole, the fp32 master sharded with the moments. bf16-params: 2 + 2 + 4.
    """
    if zero == 1 and precision in ("bf16", "fp16"):
        return 2, 2, 12
    return {"fp32": (4, 4, 8), "bf16": (4, 2, 8), "fp16": (4, 2, 8), "bf16-params": (2, 2, 4)}[precision]


def compute_bytes(precision: str) -> int:
    """Bytes of a parameter as the model computes with it: what ZeRO-2/3 gathers and reduce-scatters."""
    return 4 if precision == "fp32" else 2


def zero_table(psi: float, n: int, k: int = 12, p: int = 2, g: int = 2) -> dict[str, float]:
    """ZeRO paper Table 1: bytes per device of baseline, P_os, P_os+g and P_os+g+p for Psi parameters on n devices."""
    return {
        "baseline": (p + g + k) * psi,
        "os": (p + g) * psi + k * psi / n,
        "os+g": p * psi + (g + k) * psi / n,
        "os+g+p": (p + g + k) * psi / n,
    }


def _shard_ways(leaf: Leaf, shape: dict[str, int], over_data: bool) -> int:
    """Devices one copy of `leaf` is split over: its rules' mesh axes, and `data` under ZeRO (jaxpar.parallel.zero)."""
    from jaxpar.core import zero_layout as zero_lib
    spec = rules_lib.resolve_spec(leaf.names, leaf.shape, shape, rules_lib.DEFAULT_RULES, path=leaf.path)
    ways = math.prod(shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    if over_data and zero_lib.choose_dim(leaf.names, leaf.shape, spec, shape["data"]) is not None:
        ways *= shape["data"]
    return ways


@dataclasses.dataclass(frozen=True)
class Inventory:
    """Parameters per device under one mesh: whole (tensor/pipe/expert sharding only) and under ZeRO."""

    local: float  # parameters per device before ZeRO
    sharded: float  # parameters per device with ZeRO's `data` dimension added
    stacked_local: float  # the layer-stacked part of `local`
    stacked_sharded: float
    replicated_over_pipe: float  # parameters every pipe stage holds (embedding, head, final norm)
    dense_replicated_over_expert: float  # `local` parameters not split over expert (their gradients sum over it)


@functools.lru_cache(maxsize=4096)
def inventory(model: Model, data: int, tensor: int, pipe: int, expert: int) -> Inventory:
    shape = {"data": data, "tensor": tensor, "pipe": pipe, "expert": expert}
    local = sharded = st_local = st_sharded = rep_pipe = rep_expert = 0.0
    for leaf in model.leaves:
        whole, split = leaf.size / _shard_ways(leaf, shape, False), leaf.size / _shard_ways(leaf, shape, True)
        local, sharded = local + whole, sharded + split
        if leaf.stacked:
            st_local, st_sharded = st_local + whole, st_sharded + split
        else:
            rep_pipe += whole
        if "experts" not in leaf.names:
            rep_expert += whole
    return Inventory(local, sharded, st_local, st_sharded, rep_pipe, rep_expert)


def remat_policy(layout: Layout) -> str:
    """The checkpoint policy a block really runs under (jaxpar.parallel.stack.remat_wrapper): ZeRO-3 turns `none`
    into saving every matmul output (`dots`), so the gathered weights themselves are never kept."""
    if layout.zero == 3 and layout.data > 1 and layout.remat == "none":
        return "dots"
    return layout.remat


def activation_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Values one block keeps per token for its backward pass (Korthikanti et al. 2022, Table 2 adapted).

    none: a Llama block without dropout keeps the two norms' inputs and outputs
    (4 d), Q, K, V (h hd + 2 kv hd), the softmax probabilities (h s), the
    attention output entering the projection (h hd) and the MLP's gate, up and
    their product (3 f). dots (ZeRO-3's policy): every matmul output: Q, K, V,
    the scores, the attention output, both projections' outputs (2 d) and gate
    and up. selective: the weight matmuls' outputs: Q, K, V, gate, up and the
    two row-parallel outputs (2 d). full: the block input (d). Tensor
    parallelism splits all but the d-sized values by t; sequence parallelism
    those too.

    Where the block has no collective inside (no tensor split, no ZeRO-2/3
    gather), XLA fuses each projection into its consumer, so selective remat
    leaves only gate and up (2 f) to keep; where it has one, the collectives
    cut those fusions, and without remat the block also keeps the
    intermediates a fused block recomputes: the scores twice (before and after
    the softmax), 6 d-sized and 8 f-sized values (fused gate|up, silu, its
    product, ...).
    """
    t = layout.tensor
    d, hd, h, kv, f = model.d_model, model.head_dim, model.n_heads, model.n_kv_heads, model.d_ff
    d_split = t if layout.sequence_parallel else 1
    qkv = (h + 2 * kv) * hd / t
    policy = remat_policy(layout)
    split = t > 1 or (layout.zero >= 2 and layout.data > 1)
    if policy == "full":
        return d / d_split
    if policy == "selective":
        return qkv + 2 * f / t + 2 * d / d_split if split else 2 * f
    if policy == "dots":
        return qkv + h * seq / t + h * hd / t + 2 * f / t + 2 * d / d_split
    if split:
        return 2 * h * seq / t + 6 * d / d_split + 8 * f / t + qkv + (h + kv) * hd / t
    return 4 * d / d_split + qkv + h * seq / t + h * hd / t + 3 * f / t


def moe_mlp_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """What a MoE layer keeps per token in place of the dense MLP: the router's logits (E), and per
    capacity slot (E C / group of them per token) the dispatched input and the combined output (2 d)
    and the expert's gate, up and product (3 fe, split by t)."""
    group = model.group_size or seq
    slots = model.n_experts * capacity(model, group) / group
    return model.n_experts + slots * (2 * model.d_model + 3 * model.expert_d_ff / layout.tensor)


def capacity(model: Model, group: int) -> int:
    """Slots per expert in a routing group (jaxpar.parallel.experts.MoEConfig.capacity)."""
    if model.dropless:
        return group
    return max(1, min(group, math.ceil(model.top_k * group * model.capacity_factor / model.n_experts - 1e-9)))


def schedule_ticks(layout: Layout) -> int:
    """Forward ticks of the pipeline's tick table (each runs a chunk of L/(p v) layers on every stage)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    if p == 1:
        return 1
    if layout.schedule == "interleaved":
        groups = -(-m // p)
        return (groups - 1) * v * p + (v - 1) * p + (m - 1 - (groups - 1) * p) + p
    return m + p - 1


def bubble(layout: Layout) -> float:
    """Idle share of a stage's slots: (p - 1) / (v m + p - 1) (GPipe, 1F1B; interleaved with v chunks)."""
    p, m, v = layout.pipe, layout.microbatches, layout.virtual_stages
    return (p - 1) / (v * m + p - 1) if p > 1 else 0.0


def megatron_bubble(p: int, m: int, v: int = 1) -> float:
    """Megatron-LM (Narayanan et al. 2021): bubble time over ideal time, (p - 1) / (v m)."""
    return (p - 1) / (v * m)


def explicit_backward(layout: Layout) -> bool:
    """A pipeline whose backward slots are in the tick table (1F1B, interleaved): residuals live in a ring."""
    return layout.pipe > 1 and layout.schedule in schedule_lib.EXPLICIT


@functools.lru_cache(maxsize=None)
def _ring_rows(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> int:
    """The residual ring's rows of a tick table (built once per shape: the enumeration asks often)."""
    return schedule_lib.Schedule(schedule, stages, microbatches, virtual_stages).in_flight


def in_flight(layout: Layout) -> int:
    """Chunk-sized activation sets a stage keeps at the peak (jaxpar.pipeline.executor's schedules).

    No pipeline: one microbatch. GPipe differentiates the tick scan, so every
    tick's residuals stay (bubble ticks too); 1F1B and interleaved keep the rows
    of their residual ring (at most 2p - 2 microbatches under 1F1B).
    """
    if layout.pipe == 1:
        return 1
    if explicit_backward(layout):
        return _ring_rows(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
    return schedule_ticks(layout)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The global batch of one optimizer step."""

    batch_size: int  # sequences
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def local_seq(layout: Layout, work: Workload) -> int:
    """Positions of a sequence on one device: context parallelism splits them over `context`."""
    return work.seq_len // layout.context


def scores_kept(layout: Layout, seq: int) -> int:
    """Keys per query whose scores a block keeps for its backward pass: none under context parallelism,
    whose attention is a custom VJP that saves q, k and v and recomputes the rest (jaxpar.parallel.attention)."""
    return seq if layout.context == 1 else 0


def microbatch_sequences(layout: Layout, work: Workload) -> int:
    """Sequences in one microbatch on one device (the batch over data x expert, accumulation, microbatches)."""
    ways = layout.replica * layout.data * layout.expert * layout.grad_accum * layout.microbatches
    return work.batch_size // ways


# -- collectives ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """Calls of one collective kind over one mesh axis per step: `bytes` is the whole buffer of one call
    (buffers XLA reduces in one go, e.g. all gradients, are counted as one call)."""

    axis: str
    kind: str
    bytes: float
    calls: float
    why: str

    def traffic(self, n: int) -> float:
        return self.calls * ring_traffic(self.kind, self.bytes, n)


def collectives(model: Model, layout: Layout, work: Workload, device: Device) -> list[Collective]:
    """Every collective of one step, per device: what the compiled step runs, by jaxpar's own layers."""
    inv = inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert)
    p_bytes, g_bytes, _ = state_bytes_per_param(layout.precision, layout.zero if layout.data > 1 else 0)
    if layout.zero >= 2:  # the layers gather their compute-dtype casts; autodiff reduce-scatters in that dtype
        p_bytes = g_bytes = compute_bytes(layout.precision)
    # A backend that widens low-precision collectives (XLA:CPU) sums them in fp32; the ones jaxpar writes
    # that only move data carry their 16-bit bits (jaxpar.parallel.bits), and those the compiler places are widened.
    wide = 4 if device.widens_low_precision else None
    p_comm, g_comm = p_bytes, wide or g_bytes
    act = DTYPE_BYTES[layout.precision] if layout.precision != "bf16-params" else 2
    act_sum = wide or act
    b, s, d = microbatch_sequences(layout, work), local_seq(layout, work), model.d_model
    out: list[Collective] = []
    n, t, p, e, c = layout.data, layout.tensor, layout.pipe, layout.expert, layout.context
    if n > 1:
        # local = split + whole and sharded = split / n + whole, where `whole` are the parameters ZeRO
        # cannot split over data (no dimension divides): their gradients keep an all-reduce
        split = (inv.local - inv.sharded) * n / (n - 1) if layout.zero else 0.0
        unsharded = inv.local - split
        if layout.zero == 0:
            out.append(Collective("data", "all-reduce", inv.local * g_comm, 1, "gradients summed over data"))
        else:
            # ZeRO-1 reduce-scatters the accumulated gradient and gathers the updated parameters once per
            # step. ZeRO-2/3 gather inside the loss: the layers once per stage program run (per microbatch,
            # per pipeline tick) and again for the backward pass under ZeRO-3, the rest once (XLA hoists
            # that gather out of the accumulation loop); autodiff reduce-scatters each gather's gradient.
            stacked_split = inv.stacked_local * split / inv.local if inv.local else 0.0
            rest, layers = split - stacked_split, stacked_split
            lookup = sharded_lookup(model, layout)
            if lookup and model.separate_head:
                rest -= model.vocab * d  # the table is used nowhere else: neither gathered nor reduce-scattered
            scattered = rest + layers
            if layout.zero >= 2:
                layers *= layout.grad_accum * schedule_ticks(layout)
                scattered = rest * layout.grad_accum + layers
            gathered = rest + layers * (2 if layout.zero == 3 else 1)
            out.append(Collective("data", "reduce-scatter", scattered * g_comm, 1, "gradients into ZeRO shards"))
            out.append(Collective("data", "all-gather", gathered * p_comm, 1,
                                  "ZeRO parameters gathered" + (" per layer" if layout.zero >= 2 else " after the update")))
            if unsharded > 0.5:
                out.append(Collective("data", "all-reduce", unsharded * g_comm, 1, "gradients ZeRO leaves whole"))
            if lookup:  # per embedding run: one per microbatch, under a pipeline one per tick
                rows = b * n * s * layout.grad_accum * (schedule_ticks(layout) if p > 1 else 1)
                out.append(Collective("data", "all-gather", rows * (4 + d * act), 1,
                                      "the data group's tokens, and its embedding rows' cotangents"))
                out.append(Collective("data", "reduce-scatter", rows * d * act_sum, 1,
                                      "embedding rows looked up in each rank's shard, summed back to their ranks"))
    if t > 1:
        # Megatron: each block half ends in one all-reduce (SP: a reduce-scatter, and starts with an
        # all-gather) forward, and one more in the backward pass. Full remat re-runs the forward in the
        # backward pass, but only the attention half's all-reduce feeds anything the gradients need.
        chunk = model.n_layers / (p * layout.virtual_stages)  # layers one tick runs
        ticks = schedule_ticks(layout)
        block = ticks * chunk * (4 + (layout.remat == "full"))
        one = b * s * d  # elements
        if p == 1:
            edges = 2 * one  # the vocab-parallel embedding's sum, the head input's gradient
        elif layout.schedule == "1f1b":
            edges = ticks * one + layout.microbatches * one / p  # embedding on every forward slot; head per microbatch
        else:
            edges = layout.microbatches * one * (1 + 1 / p)  # all microbatches embedded at once; one head
        kinds = ("all-reduce",)
        if layout.sequence_parallel:
            annotated = layout.tensor_form == "annotation" and device.scatter_as_all_reduce
            kinds = ("all-gather", "all-reduce" if annotated else "reduce-scatter")
        for k in kinds:
            width = act if k == "all-gather" and layout.tensor_form == "explicit" else act_sum
            out.append(Collective("tensor", k, one * width, block * layout.grad_accum, "Megatron f/g, per block half"))
            out.append(Collective("tensor", k, edges * width, layout.grad_accum, "vocab-parallel embedding and head"))
    if p > 1:
        ticks = schedule_ticks(layout)
        one = b * s * d * act / (t if layout.sequence_parallel else 1)
        m = layout.microbatches
        if layout.schedule == "1f1b":
            # warm-up, steady and cool-down ticks; the cool-down's last send has no receiver and is dropped
            out.append(Collective("pipe", "collective-permute", one, (2 * ticks - 1) * layout.grad_accum,
                                  "activations forward and cotangents backward, one per tick"))
            out.append(Collective("pipe", "all-to-all", one, m * layout.grad_accum, "the loss head's positions"))
            out.append(Collective("pipe", "all-gather", one, m * layout.grad_accum, "the head's input gradients"))
        else:
            out.append(Collective("pipe", "collective-permute", one, 2 * ticks * layout.grad_accum,
                                  "activations forward and cotangents backward, one per tick"))
            out.append(Collective("pipe", "all-to-all", one * m, 2 * layout.grad_accum,
                                  "the loss head's positions and their gradients"))
        out.append(Collective("pipe", "all-reduce", inv.replicated_over_pipe * max(g_comm, 4), 1,
                              "embedding and head gradients summed over stages (fp32)"))
    if layout.replica > 1:
        # HSDP: each gradient leaves the ZeRO group reduced to its data shard, then one all-reduce over replica
        out.append(Collective("replica", "all-reduce", inv.sharded * g_comm, 1, "gradient shards summed over replicas"))
    if c > 1:
        out += context_collectives(model, layout, work, inv.local * g_comm, act, act_sum)
    if e > 1 and model.n_experts:
        group = model.group_size or s
        groups = b * s // group
        slots = model.n_experts * capacity(model, group) * groups  # per device per MoE layer
        buffer = slots * d * act / t
        # to the experts and back, forward and backward; a remat policy re-runs the forward pair (an
        # all-to-all is no matmul, so no policy saves its output)
        calls = (4 + 2 * (remat_policy(layout) != "none")) * model.moe_layers / p * layout.grad_accum
        out.append(Collective("expert", "all-to-all", buffer, calls, "tokens to their experts and back"))
        # Parameters every expert rank holds sum their gradients over expert, except the embedding table
        # when gathering its cotangents and token ids over expert is cheaper than summing the table.
        rows = e * b * s * layout.grad_accum
        table = model.vocab * d / t if rows <= model.vocab / t else 0.0
        out.append(Collective("expert", "all-reduce", (inv.dense_replicated_over_expert - table) * g_comm, 1,
                              "gradients of parameters every expert rank holds"))
        if table:
            out.append(Collective("expert", "all-gather", rows * (d * act_sum + 4), 1,  # placed by the compiler
                                  "the embedding's cotangents and token ids"))
    return out


def sharded_lookup(model: Model, layout: Layout) -> bool:
    """Whether ZeRO-2/3 look the tokens up in each data rank's rows of the embedding table
    (jaxpar.parallel.tensor.embedding_lookup) instead of gathering it: ZeRO splits the table along the vocabulary
    (its larger dimension, dividing by data) and no tensor axis splits it."""
    v, d, n = model.vocab, model.d_model, layout.data
    return layout.zero >= 2 and n > 1 and layout.tensor == 1 and v % n == 0 and (v >= d or d % n)


def context_collectives(model: Model, layout: Layout, work: Workload, grad_bytes: float, value_bytes: int,
                        summed_value_bytes: int) -> list[Collective]:
    """Context parallelism's collectives: K/V of every layer's attention, and the gradients summed over context.

    The all-gather form gathers K and V (one call each) in the forward and
    again where the backward recomputes it, then reduce-scatters their
    gradients; the ring form passes each K and V block C - 1 hops in the
    forward, the recomputation and the backward (the gradients travel with
    the blocks): 3 (C - 1) blocks per array either way. The parameters are
    whole on every context rank, so their gradients are all-reduced over it.
    An element of K or V takes `value_bytes` where it is moved and
    `summed_value_bytes` where its gradients are summed.
    """
    c, kv = layout.context, model.n_kv_heads / layout.tensor
    b, s = microbatch_sequences(layout, work), work.seq_len
    runs = model.n_layers * layout.grad_accum * layout.microbatches / layout.pipe  # layer runs per device
    elements = b * s * kv * model.head_dim  # one of K, V over the whole sequence
    whole = elements * value_bytes
    out = [Collective("context", "all-reduce", grad_bytes, 1, "gradients summed over context")]
    if layout.context_form == "ring":
        out.append(Collective("context", "collective-permute", whole / c, 2 * 3 * (c - 1) * runs,
                              "K and V blocks around the ring: forward, recomputation, gradients"))
    else:
        out.append(Collective("context", "all-gather", whole, 2 * 2 * runs, "K and V gathered: forward, recomputation"))
        out.append(Collective("context", "reduce-scatter", elements * summed_value_bytes, 2 * runs,
                              "K and V gradients back to their ranks"))
    return out


def traffic_per_axis(colls: list[Collective], layout: Layout) -> dict[str, float]:
    out = {a: 0.0 for a in AXES}
    for c in colls:
        out[c.axis] += c.traffic(layout.shape[c.axis])
    return out


# -- FLOPs and time --------------------------------------------------------------------------


def flops_per_token(model: Model, seq: int) -> float:
    """Model FLOPs of one token's forward and backward: 6 N + 12 L s (h hd) (attention's two matmuls, x3)."""
    return 6 * model.flop_params + 12 * model.n_layers * seq * model.n_heads * model.head_dim


def recompute_flops_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Extra FLOPs of recomputation: a whole forward (full) or the attention matmuls (selective)."""
    attention = 4 * model.n_layers * seq * model.n_heads * model.head_dim
    if layout.remat == "full":
        return 2 * (model.flop_params - model.vocab * model.d_model) + attention
    if layout.remat == "selective":
        return attention
    return 0.0


@dataclasses.dataclass
class Estimate:
    """Everything the planner predicts for one layout (bytes per device, seconds per step)."""

    layout: Layout
    memory: dict[str, float]
    collectives: list[Collective]
    traffic: dict[str, float]
    bubble: float
    flops: float  # model FLOPs per device per step (no recomputation)
    hardware_flops: float  # with recomputation
    time: dict[str, float]
    mfu: float
    fits: bool
    reason: str = ""

    @property
    def step_time(self) -> float:
        return self.time["step"]

    @property
    def peak(self) -> float:
        return self.memory["total"]

    def to_dict(self) -> dict:
        return {
            "layout": str(self.layout), "mesh": self.layout.shape, "options": self.layout.options(),
            "memory": self.memory, "traffic": self.traffic, "bubble": self.bubble, "flops": self.flops,
            "hardware_flops": self.hardware_flops, "time": self.time, "mfu": self.mfu, "fits": self.fits,
            "reason": self.reason,
            "collectives": [dataclasses.asdict(c) | {"traffic": c.traffic(self.layout.shape[c.axis])}
                            for c in self.collectives],
        }


def check(model: Model, layout: Layout, work: Workload) -> str:
    """Why `layout` cannot run `model` on `work` ('' when it can): the divisibility jaxpar itself enforces."""
    from jaxpar.pipeline.schedule import validate

    try:
        if layout.pipe > 1:
            validate(layout.schedule, layout.pipe, layout.microbatches, layout.virtual_stages)
        inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert)
    except ValueError as error:
        return str(error)
    ways = layout.replica * layout.data * layout.expert * layout.grad_accum * layout.microbatches
    if work.batch_size % ways:
        return f"batch {work.batch_size} does not divide by replica x data x expert x grad_accum x microbatches = {ways}"
    if layout.pipe > 1 and model.scan_depth % (layout.pipe * layout.virtual_stages):
        return f"{model.scan_depth} layers do not split into pipe={layout.pipe} x virtual_stages={layout.virtual_stages}"
    if layout.pipe > 1 and work.seq_len % layout.pipe:
        return f"sequence {work.seq_len} does not divide by pipe={layout.pipe} (the loss head splits positions)"
    if layout.pipe > 1 and model.n_experts:
        return "the MoE model does not run under pipe > 1"
    if layout.expert > 1 and not model.n_experts:
        return f"expert={layout.expert} but the model has no experts"
    if model.n_experts and model.n_experts % layout.expert:
        return f"{model.n_experts} experts do not divide by expert={layout.expert}"
    if layout.replica > 1 and (layout.zero == 0 or layout.data == 1):
        return f"replica={layout.replica} without ZeRO over data is plain data parallelism: use data"
    if work.seq_len % (2 * layout.context):
        return (f"sequence {work.seq_len} does not divide by 2 x context={layout.context} (two mirrored chunks "
                "per context rank)")
    if layout.pipe > 1 and layout.context > 1:
        return ("pipe with context is not modelled yet: the pipeline's ticks each sum their weight "
                "gradients over context")
    if layout.sequence_parallel and work.seq_len % layout.tensor:
        return f"sequence {work.seq_len} does not divide by tensor={layout.tensor} (sequence parallelism)"
    return ""


def estimate(model: Model, layout: Layout, work: Workload, device: Device | str = "h100") -> Estimate:
    """The analytic model of one layout: memory breakdown, traffic per axis, bubble, FLOPs, time, MFU."""
    device = load_device(device) if isinstance(device, str) else device
    reason = check(model, layout, work)
    if reason:
        return Estimate(layout, {"total": math.inf}, [], {}, 0.0, 0.0, 0.0, {"step": math.inf}, 0.0, False, reason)
    memory = memory_breakdown(model, layout, work, device)
    colls = collectives(model, layout, work, device)
    traffic = traffic_per_axis(colls, layout)
    tokens_per_device = work.tokens / (layout.replica * layout.data * layout.expert * layout.context)
    flops = flops_per_token(model, work.seq_len) * tokens_per_device / (layout.tensor * layout.pipe)
    hw = flops + recompute_flops_per_token(model, layout, work.seq_len) * tokens_per_device / (layout.tensor * layout.pipe)
    time = step_time(model, layout, work, device, hw, traffic, memory)
    mfu = flops / (time["step"] * device.flops(layout.precision)) if time["step"] > 0 else 0.0
    fits = memory["total"] <= device.capacity
    why = "" if fits else (f"needs {memory['total'] / 1e9:.1f} GB per device, {device.name} has "
                           f"{device.capacity / 1e9:.1f} GB usable")
    return Estimate(layout, memory, colls, traffic, bubble(layout), flops, hw, time, mfu, fits, why)


def memory_breakdown(model: Model, layout: Layout, work: Workload, device: Device) -> dict[str, float]:
    """Bytes per device: params, grads, optimizer (ZeRO Table 1 on the local shard), activations, temp.

    `arguments` is what the compiled step takes in (parameters, optimizer state,
    batch); `temp` what it allocates while running (gradients, activations,
    gathered parameters, the update's workspace). total = arguments + temp.
    """
    inv = inventory(model, layout.data, layout.tensor, layout.pipe, layout.expert)
    P, G, K = state_bytes_per_param(layout.precision, layout.zero if layout.data > 1 else 0)
    if device.low_precision_in_fp32:
        G = 4  # the backend differentiates low-precision matmuls in fp32: gradients (and activations) are fp32
    n = layout.data
    z = layout.zero if n > 1 else 0
    # ZeRO-2 keeps parameters sharded between steps but gathers every layer's for the whole step (held, as in
    # the paper's P_os+g); ZeRO-3 holds its shard and gathers one layer at a time.
    C = compute_bytes(layout.precision)  # what ZeRO-2/3 gather: the compute-dtype casts
    at_rest = P * (inv.sharded if z >= 2 else inv.local)
    params = P * inv.sharded if z == 3 else C * inv.local if z == 2 else at_rest
    optimizer = K * (inv.sharded if z >= 1 else inv.local)
    # ZeRO's gradient: the whole local gradient under ZeRO-0/1 (reduced once per step), the data shard under
    # ZeRO-2/3, which reduce-scatter each layer's gradient as soon as the backward pass produces it.
    grads = G * (inv.sharded if z >= 2 else inv.local)
    per_layer = inv.stacked_local / max(model.scan_depth / layout.pipe, 1)
    outside = inv.local - inv.stacked_local  # gathered and differentiated whole under ZeRO-2/3
    if sharded_lookup(model, layout) and model.separate_head:
        outside -= model.vocab * model.d_model  # except a table looked up in its shards (its gradient stays one)
    transient = G * (per_layer + outside) if z >= 2 else 0.0  # one layer's whole gradient
    if (layout.grad_accum > 1 or layout.pipe > 1) and G < 4:
        transient += 4 * (inv.sharded if z >= 2 else inv.local)  # fp32 accumulators of low-precision gradients
    if device.widens_low_precision and G < 4 and z <= 1 and n > 1:
        transient += (4 - G) * inv.local  # the fp32 copy of the whole gradient a widened reduction takes
    act_bytes = 4 if layout.precision == "fp32" or device.low_precision_in_fp32 else 2
    b, s = microbatch_sequences(layout, work), work.seq_len
    activations = activation_bytes(model, layout, work, act_bytes, (C if z == 2 else P) * inv.stacked_local)
    gathered = 0.0  # ZeRO-3: one layer's parameters (and the ones outside the layer stack) gathered at a time
    if z == 3:
        gathered = C * (per_layer + outside - (inv.sharded - inv.stacked_sharded))
    workspace = transient + layer_workspace(model, layout, work) + update_workspace(inv, layout, z, G)
    batch = 2 * 4 * b * s * layout.grad_accum * layout.microbatches
    host = offloaded_bytes(layout, z, at_rest, optimizer)
    arguments = at_rest + optimizer + batch - host
    temp = (params - at_rest) + grads + activations + gathered + workspace
    if host:  # copied in for the update, into the space the activations held (dead by then)
        temp = max(temp, (params - at_rest) + grads + gathered + transient + update_workspace(inv, layout, z, G) + host)
    return {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "temp": gathered + workspace, "batch": batch, "arguments": arguments, "temp_total": temp,
        "host": host, "total": arguments + temp,
    }


def offloaded_bytes(layout: Layout, zero: int, params_at_rest: float, optimizer: float) -> float:
    """Bytes per device `--offload optimizer` keeps in host memory between steps: the optimizer state, and
    the fp32 parameters under bf16/fp16 (held once, they are the master; jaxpar.parallel.offload) except under
    ZeRO-1, whose master is part of the optimizer state and whose 2-byte parameters stay."""
    if layout.offload == "none":
        return 0.0
    master = layout.precision in ("bf16", "fp16") and zero != 1
    return optimizer + (params_at_rest if master else 0.0)


def block_values_per_token(model: Model, layout: Layout, seq: int) -> float:
    """Values one block keeps per token for the backward pass, by where it runs.

    A plain layer scan keeps what its remat policy saves (`activation_values_per_token`;
    a MoE block its experts' slots in place of the MLP). Without remat, a pipeline
    keeps more: the block's values as its stage VJP's residuals (per token
    2 h s + 6 f + 2 (h + kv) hd split by t, and 6 d), masked by each tick's
    validity in GPipe's differentiated tick scan, in the residual ring's rows
    under 1F1B and interleaved (the rows' shapes in the compiled step); tensor
    parallelism adds 3 d whole (Megatron's f/g around each half).
    """
    t, d_split = layout.tensor, layout.tensor if layout.sequence_parallel else 1
    h, kv, hd, f, d = model.n_heads, model.n_kv_heads, model.head_dim, model.d_ff, model.d_model
    if layout.pipe > 1 and remat_policy(layout) == "none":
        return (2 * h * seq + 6 * f + 2 * (h + kv) * hd) / t + 6 * d / d_split + (3 * d if t > 1 else 0)
    values = activation_values_per_token(model, layout, seq)
    if model.n_experts and remat_policy(layout) != "full":
        share = model.moe_layers / model.n_layers
        values += share * (moe_mlp_values_per_token(model, layout, seq) - 3 * f / t)
    return values


def activation_bytes(model: Model, layout: Layout, work: Workload, value_bytes: int, stage_weights: float) -> float:
    """Activations kept per device: values per token x tokens of a microbatch x layers of a chunk x the
    chunk-sized sets alive at once (one; every tick's under GPipe; the residual ring's rows under 1F1B,
    interleaved and zb-h1). GPipe's tick scan also keeps each tick's stage weights, a per-tick
    value to autodiff; the ring keeps ZeRO-2's gathered weights with each microbatch's residuals."""
    b, s = microbatch_sequences(layout, work), local_seq(layout, work)
    layers = model.n_layers / (layout.pipe * layout.virtual_stages)
    sets = in_flight(layout)
    kept = value_bytes * b * s * block_values_per_token(model, layout, scores_kept(layout, work.seq_len)) * layers * sets
    if layout.pipe > 1 and not explicit_backward(layout):
        kept += stage_weights * schedule_ticks(layout)
    elif layout.pipe > 1 and layout.zero == 2 and layout.data > 1:
        kept += stage_weights / layout.virtual_stages * sets  # ZeRO-2's gathered weights are residuals of each microbatch's VJP
    return kept


def layer_workspace(model: Model, layout: Layout, work: Workload) -> float:
    """The largest transients of one microbatch: the fp32 logits and their gradient over the vocabulary
    shard (on each stage's share of positions under a pipeline), and one layer's attention scores when
    the backward pass recomputes them with remat. Context-parallel attention recomputes its scores too,
    but one layer's share of them is not alive at the step's peak (compiled temp at context 2 and 4)."""
    b, s = microbatch_sequences(layout, work), local_seq(layout, work)
    logits = 2 * 4 * b * s * model.vocab / layout.tensor / layout.pipe
    recomputed = remat_policy(layout) in ("full", "selective") and layout.context == 1
    return logits + (4 * b * model.n_heads / layout.tensor * s * s if recomputed else 0.0)




def update_workspace(inv: Inventory, layout: Layout, z: int, grad_bytes: int) -> float:
    """Parameter-sized transients besides ZeRO's own gradient (Table 1's G) that XLA keeps alive at once.

    The update keeps two gradient-sized buffers of the shard it runs on (the
    clipped gradient and the update itself): the whole local gradient under
    ZeRO-0, the data shard under ZeRO-1/2/3. ZeRO-1 then all-gathers the
    updated parameters into one whole buffer, which XLA places where those two
    were. A pipeline returns its gradients from a custom VJP that scales them
    by the incoming cotangent: one more copy.
    """
    whole = 2 * grad_bytes * (inv.local if z == 0 else inv.sharded)
    if z == 1:
        whole = max(whole, grad_bytes * inv.local)
    if layout.pipe > 1:
        whole += grad_bytes * (inv.sharded if z >= 2 else inv.local)
    return whole


def step_time(model, layout, work, device, hw_flops, traffic, memory) -> dict[str, float]:
    """Seconds per step: compute (stretched by the bubble), exposed communication, the optimizer update."""
    compute = hw_flops / (device.flops(layout.precision) * device.efficiency)
    compute /= 1 - bubble(layout)
    comm = {a: traffic[a] / axis_bandwidth(a, layout, device) for a in AXES}
    # Data-parallel traffic overlaps the backward pass: all of it under ZeRO-2/3 (layer by layer), only the
    # last microbatch's under ZeRO-0/1 (the gradients are reduced once per step, after accumulation).
    backward = compute * 2 / 3
    hidden = backward if layout.zero >= 2 else backward / (layout.grad_accum * max(layout.microbatches, 1))
    exposed_data = max(0.0, comm["data"] + comm["replica"] - hidden)
    update = 3 * memory["optimizer"] / device.hbm_bandwidth + 2 * memory["host"] / device.host_bandwidth
    total = compute + comm["tensor"] + comm["expert"] + comm["pipe"] + comm["context"] + exposed_data + update
    return {"compute": compute, **{f"comm_{a}": c for a, c in comm.items()}, "exposed_data": exposed_data,
            "update": update, "step": total}


def axis_bandwidth(axis: str, layout: Layout, device: Device) -> float:
    """Bytes/s one device sends over `axis`: NVLink/ICI if the axis's groups stay inside a node, else the NIC."""
    inner = math.prod(layout.shape[a] for a in AXES[AXES.index(axis) + 1:])  # AXES: outermost first
    span = inner * layout.shape[axis]
    return device.intra_bandwidth if span <= device.devices_per_node else device.inter_bandwidth


# -- enumeration and ranking --------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(model: Model, devices: int, work: Workload, device: Device, precision: str = "bf16",
            max_tensor: int | None = None, contexts: tuple[int, ...] = (1,), offload: str = "none") -> list[Layout]:
    """Every layout worth considering for `devices`: mesh factorisations x ZeRO x schedule x microbatch x remat,
    with each context size of `contexts` that splits the sequence (both attention forms), offloading or not."""
    max_tensor = max_tensor or device.devices_per_node
    out = []
    tensors = [t for t in _divisors(devices) if t <= max_tensor and model.n_kv_heads % t == 0 or t == 1]
    experts = [e for e in _divisors(devices) if model.n_experts and model.n_experts % e == 0] or [1]
    for t, e, c in itertools.product(tensors, experts, contexts):
        if c > 1 and (devices % (t * e * c) or work.seq_len % (2 * c)):
            continue
        for p in _divisors(devices // (t * e * c)):
            if model.scan_depth % p or (p > 1 and c > 1):
                continue
            n = devices // (t * e * p * c)
            local = work.batch_size / (n * e)
            if local != int(local) or local < 1:
                continue
            for b in (1, 2, 4, 8, 16, 32):
                if int(local) % b:
                    continue
                steps = int(local) // b
                for z in (0, 1, 2, 3) if n > 1 else (0,):
                    for remat in REMATS:
                        for sp in ((False, True) if t > 1 else (False,)):
                            if p == 1:
                                # context with tensor: the explicit form (jax >= 0.12 refuses the annotation form there)
                                tensor_form = "explicit" if c > 1 and t > 1 else "annotation"
                                for form in ("all-gather", "ring") if c > 1 else ("all-gather",):
                                    out.append(Layout(n, t, 1, e, z, grad_accum=steps, remat=remat, precision=precision,
                                                      sequence_parallel=sp, tensor_form=tensor_form, context=c,
                                                      context_form=form))
                                continue
                            for sched, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4)):
                                if steps < p or (sched == "interleaved" and (steps % p or model.scan_depth % (p * v))):
                                    continue
                                out.append(Layout(n, t, p, e, z, sched, steps, v, remat=remat, precision=precision,
                                                  sequence_parallel=sp))
    return [dataclasses.replace(layout, offload=offload) for layout in out] if offload != "none" else out


@dataclasses.dataclass
class Ranking:
    """The result of `plan`: fitting layouts best first, and the ones dropped with their reasons."""

    model: Model
    work: Workload
    device: Device
    devices: int
    ranked: list[Estimate]
    dropped: list[Estimate]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self, top: int = 10) -> dict:
        reasons: dict[str, int] = {}
        for est in self.dropped:
            key = est.reason.split(",")[0] if "needs" not in est.reason else "does not fit in memory"
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "model": self.model.name, "params": self.model.params, "devices": self.devices,
            "device": self.device.to_dict(), "batch_size": self.work.batch_size, "seq_len": self.work.seq_len,
            "considered": len(self.ranked) + len(self.dropped), "fitting": len(self.ranked),
            "dropped_reasons": reasons, "top": [e.to_dict() for e in self.ranked[:top]],
            "explanation": explain_choice(self),
            "ranked": [{"layout": str(e.layout), "step_time": e.step_time, "mfu": e.mfu, "memory": e.peak}
                       for e in self.ranked],
            "dropped": [{"layout": str(e.layout), "reason": e.reason} for e in self.dropped],
        }


def plan(model: Model, devices: int, work: Workload, device: Device | str = "h100", precision: str = "bf16") -> Ranking:
    """Enumerate the layouts for `devices`, drop those that cannot run or do not fit, rank by step time.

    Context parallelism joins the candidates when no layout without it fits (a sequence too long for
    one device's share of the attention), then host offload of the optimizer state when none fits still.
    """
    device = load_device(device) if isinstance(device, str) else device
    ranked, dropped = [], []
    split = tuple(c for c in _divisors(devices) if 1 < c <= device.devices_per_node)
    for contexts, offload in (((1,), "none"), (split, "none"), ((1, *split), "optimizer")):
        for layout in layouts(model, devices, work, device, precision, contexts=contexts, offload=offload):
            est = estimate(model, layout, work, device)
            (ranked if est.fits else dropped).append(est)
        if ranked:
            break
    ranked.sort(key=lambda e: (e.step_time, e.peak))
    return Ranking(model, work, device, devices, ranked, dropped)


def default_batch(model: Model, devices: int, seq_len: int) -> int:
    """A global batch of about 4M tokens (Llama 2's), at least one sequence per 8 devices."""
    tokens = max(4 * 2**20 // seq_len, 1)
    return max(2 ** round(math.log2(tokens)), 2 ** math.ceil(math.log2(max(devices // 8, 1))))


def explain_choice(ranking: Ranking) -> list[str]:
    """A few lines on why the best layout wins: its bottleneck and what the runner-up layouts lose."""
    best = ranking.best
    if best is None:
        return ["no layout fits: " + (ranking.dropped[0].reason if ranking.dropped else "none considered")]
    lay, t = best.layout, best.time
    lines = [f"{lay}: {t['step']:.3g} s/step, MFU {best.mfu:.0%}, {best.peak / 1e9:.1f} GB per device "
             f"of {ranking.device.capacity / 1e9:.0f} GB usable."]
    exposed = t["comm_tensor"] + t["comm_pipe"] + t["comm_expert"] + t["exposed_data"]
    lines.append(f"compute {t['compute']:.3g} s (bubble {best.bubble:.1%}), exposed communication "
                 f"{exposed:.3g} s (tensor {t['comm_tensor']:.3g}, pipe {t['comm_pipe']:.3g}, data "
                 f"{t['exposed_data']:.3g} of {t['comm_data']:.3g} not hidden by the backward pass).")
    if lay.tensor > 1:
        lines.append(f"tensor={lay.tensor} stays inside a node ({ranking.device.devices_per_node} devices) on "
                     f"{ranking.device.intra_bandwidth / 1e9:.0f} GB/s links; it splits the weights and activations "
                     f"that data parallelism alone would not fit.")
    if lay.pipe > 1:
        lines.append(f"pipe={lay.pipe} with {lay.microbatches} microbatches ({lay.schedule}) keeps the bubble at "
                     f"{best.bubble:.1%} while cutting each device's layers to {ranking.model.n_layers // lay.pipe}.")
    if lay.zero:
        lines.append(f"ZeRO-{lay.zero} shards the optimizer state{' and gradients' if lay.zero >= 2 else ''}"
                     f"{' and parameters' if lay.zero == 3 else ''} over data={lay.data}.")
    others = {}
    for est in ranking.ranked[1:]:
        key = (est.layout.tensor, est.layout.pipe, est.layout.data)
        if key != (lay.tensor, lay.pipe, lay.data) and key not in others:
            others[key] = est
        if len(others) == 2:
            break
    for est in others.values():
        lines.append(f"runner-up {est.layout.mesh}: {est.step_time / t['step']:.2f}x the step time "
                     f"({_bottleneck(est)}).")
    oom = [e for e in ranking.dropped if "needs" in e.reason]
    if oom:
        fastest = min(oom, key=lambda e: e.step_time)
        lines.append(f"{len(oom)} layouts do not fit (the fastest of them, {fastest.layout}, "
                     f"{fastest.reason}); {len(ranking.dropped) - len(oom)} cannot run the model.")
    return lines


def _bottleneck(est: Estimate) -> str:
    t = est.time
    costs = {"bubble": t["compute"] * est.bubble, "tensor traffic": t["comm_tensor"], "pipe traffic": t["comm_pipe"],
             "data traffic": t["exposed_data"], "expert traffic": t["comm_expert"],
             "recomputation": t["compute"] * (1 - est.flops / est.hardware_flops) if est.hardware_flops else 0.0}
    name, cost = max(costs.items(), key=lambda kv: kv[1])
    return f"mostly {name}, {cost:.3g} s"


# -- against the compiler -----------------------------------------------------------------------


def compiled_figures(summary: dict) -> dict[str, float]:
    """The quantities the planner predicts, from `jaxpar inspect --json` (jaxpar.run.report.inspection)."""
    out = {"arguments": float(summary["memory"]["arguments"]), "temp": float(summary["memory"]["temp"])}
    for axis in AXES:
        out[f"traffic_{axis}"] = sum(r["traffic"] for r in summary["collectives"] if r["axes"] == [axis])
    out["traffic_other"] = sum(r["traffic"] for r in summary["collectives"] if len(r["axes"]) != 1)
    return out


def predicted_figures(est: Estimate) -> dict[str, float]:
    out = {"arguments": est.memory["arguments"], "temp": est.memory["temp_total"]}
    for axis in AXES:
        out[f"traffic_{axis}"] = est.traffic.get(axis, 0.0)
    return out


def ratios(est: Estimate, summary: dict) -> dict[str, float]:
    """prediction / compiled for argument bytes, temp bytes and traffic per mesh axis (axes with traffic)."""
    got, want = predicted_figures(est), compiled_figures(summary)
    out = {}
    for key, value in got.items():
        if want[key] or value:
            out[key] = value / want[key] if want[key] else math.inf
    return out


# -- what `jaxpar plan` shows ------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x < 1e13 else "inf"


def run_command(model_name: str, est: Estimate, work: Workload) -> str:
    """The `jaxpar train` command line that runs this layout."""
    flags = [f"--model {model_name}", f"--mesh {est.layout.mesh}", f"--batch-size {work.batch_size}",
             f"--seq-len {work.seq_len}"]
    for key, value in est.layout.options().items():
        flag = "--" + key.replace("_", "-")
        flags.append((flag if value else "--no-" + flag[2:]) if isinstance(value, bool) else f"{flag} {value}")
    return "jaxpar train " + " ".join(flags)


def config_toml(model_name: str, est: Estimate, work: Workload) -> str:
    """A `jaxpar train --config FILE` file for this layout ([model], [train], [mesh], [plan] tables)."""
    mesh = "\n".join(f"{a} = {n}" for a, n in est.layout.shape.items())
    plan_lines = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v if isinstance(v, int) else repr(v)}"
                           .replace("'", '"') for k, v in est.layout.options().items())
    return (f"# jaxpar plan: {est.layout}\n# predicted {est.step_time:.3g} s/step, MFU {est.mfu:.0%}, "
            f"{_gb(est.peak)} GB per device\n[model]\nname = \"{model_name}\"\n\n[train]\n"
            f"batch_size = {work.batch_size}\nseq_len = {work.seq_len}\n\n[mesh]\n{mesh}\n\n[plan]\n{plan_lines}\n")


def table(ranking: Ranking, top: int = 10):
    """The ranked layouts as a rich table: memory breakdown (GB), traffic per axis (GB), bubble, time, MFU."""
    from rich.table import Table

    precision = ranking.ranked[0].layout.precision if ranking.ranked else ""
    t = Table(title=f"{ranking.model.name} ({ranking.model.params / 1e9:.3g}B parameters) on {ranking.devices} x "
                    f"{ranking.device.name}, {precision}: batch {ranking.work.batch_size} x {ranking.work.seq_len} "
                    f"tokens; memory and traffic in GB per device per step")
    for col in ("#", "layout", "params", "grads", "optim", "activ", "temp", "total", "data", "tensor", "pipe",
                "expert", "bubble", "step s", "MFU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, est in enumerate(ranking.ranked[:top], 1):
        m, tr = est.memory, est.traffic
        t.add_row(str(i), est.layout.label(precision=False), _gb(m["params"]), _gb(m["grads"]), _gb(m["optimizer"]),
                  _gb(m["activations"]), _gb(m["temp"]), _gb(m["total"]),
                  *(_gb(tr.get(a, 0.0)) for a in ("data", "tensor", "pipe", "expert")),
                  f"{est.bubble:.1%}", f"{est.step_time:.3g}", f"{est.mfu:.0%}")
    return t


def explain(est: Estimate, device: Device) -> list[str]:
    """One layout's breakdown: memory, every collective, bubble, FLOPs and time."""
    if est.reason and not est.memory.get("params"):
        return [f"{est.layout}: cannot run: {est.reason}"]
    m, t = est.memory, est.time
    lines = [f"layout {est.layout} on {est.layout.devices} x {device.name}"]
    lines.append("memory per device (GB): " + ", ".join(
        f"{k} {_gb(m[k])}" for k in ("params", "grads", "optimizer", "activations", "temp", "batch", "total"))
        + (f" -> fits in {_gb(device.capacity)} usable" if est.fits else f" -> does NOT fit: {est.reason}"))
    lines.append("collectives per device per step:")
    for c in est.collectives:
        lines.append(f"  {c.axis:7s} {c.kind:18s} {c.calls:8.0f} calls x {c.bytes / 1e6:10.3f} MB -> "
                     f"{c.traffic(est.layout.shape[c.axis]) / 1e9:8.3f} GB traffic  ({c.why})")
    lines.append(f"bubble {est.bubble:.1%}; model FLOPs {est.flops:.3g} per device (with recomputation "
                 f"{est.hardware_flops:.3g})")
    lines.append("time (s): " + ", ".join(f"{k} {v:.3g}" for k, v in t.items()) + f"; MFU {est.mfu:.1%}")
    return lines


def save_pictures(ranking: Ranking, prefix: str, top: int = 6) -> list[str]:
    """PNG pictures: memory per device of the top layouts (stacked bars), and step time under strong and
    weak scaling. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    parts = ("params", "grads", "optimizer", "activations", "temp")
    shown = ranking.ranked[:top]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(shown) + 2), 4.5))
    bottom = [0.0] * len(shown)
    for part in parts:
        values = [e.memory[part] / 1e9 for e in shown]
        ax.bar(range(len(shown)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(ranking.device.capacity / 1e9, color="k", ls="--", lw=1, label=f"usable {ranking.device.name}")
    ax.set_xticks(range(len(shown)), [str(e.layout).replace(" ", "\n", 1).replace(" precision", "\nprecision")
                                      for e in shown], fontsize=6)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{ranking.model.name} on {ranking.devices} x {ranking.device.name}: memory of the top layouts",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(f"{prefix}_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    strong, weak = scaling(ranking)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [n for n, _ in strong]
    a1.loglog(xs, [e.step_time if e else float("nan") for _, e in strong], "o-", label="predicted best layout")
    base = next(((n, e.step_time) for n, e in strong if e), None)
    if base:
        a1.loglog(xs, [base[1] * base[0] / n for n in xs], "k:", label="linear scaling")
    a1.set_xlabel("devices")
    a1.set_ylabel("step time (s)")
    a1.set_title(f"strong scaling: {ranking.model.name}, batch {ranking.work.batch_size}", fontsize=9)
    a1.legend(fontsize=7)
    a2.plot(range(len(weak)), [e.step_time if e else float("nan") for _, _, e in weak], "o-")
    a2.set_xticks(range(len(weak)), [f"{name}\n{n} dev" for name, n, _ in weak], fontsize=7)
    a2.set_ylabel("step time (s)")
    a2.set_title("weak scaling: model size at fixed tokens per device", fontsize=9)
    fig.tight_layout()
    paths.append(f"{prefix}_scaling.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def scaling(ranking: Ranking):
    """Best layouts for 1/8 .. 8x the devices at the same batch (strong), and for the registry's model
    sizes with devices grown in proportion to parameters at the same tokens per device (weak)."""
    fast = dict(precision=ranking.ranked[0].layout.precision if ranking.ranked else "bf16")
    strong = []
    for factor in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8):
        n = int(ranking.devices * factor)
        if n < 1 or ranking.work.batch_size * 8 < n:
            continue
        r = plan(ranking.model, n, ranking.work, ranking.device, **fast)
        strong.append((n, r.best))
    weak = []
    tokens_per_device = ranking.work.tokens / ranking.devices
    for name in ("1b", "7b", "70b", "405b"):
        try:
            model = Model.named(name)
        except ValueError:
            continue
        n = max(8, 2 ** round(math.log2(ranking.devices * model.params / ranking.model.params)))
        batch = max(1, int(tokens_per_device * n // model_seq(name)))
        r = plan(model, n, Workload(batch, model_seq(name)), ranking.device, **fast)
        weak.append((name, n, r.best))
    return strong, weak


def model_seq(name: str) -> int:
    from jaxpar.models import model_config

    return model_config(name).seq_len


def main(args) -> int:
    """`jaxpar plan`: rank the layouts, or explain one; table, JSON, pictures, a runnable config."""
    import json
    import sys

    from rich.console import Console

    console = Console(stderr=bool(args.json))
    if not console.is_terminal:
        console.width = 220
    try:
        device = load_device(args.device)
        if args.hosts:
            if args.devices % args.hosts:
                raise ValueError(f"--devices {args.devices} do not divide over --hosts {args.hosts}")
            device = dataclasses.replace(device, devices_per_node=args.devices // args.hosts)
        model = Model.named(args.model, {"seq_len": args.seq_len} if args.seq_len else None)
        seq = args.seq_len or model_seq(args.model)
        work = Workload(args.batch_size or default_batch(model, args.devices, seq), seq)
        if args.explain:
            layout = dataclasses.replace(Layout.parse(args.explain), precision=args.precision) \
                if "precision" not in args.explain else Layout.parse(args.explain)
            if layout.devices != args.devices:
                raise ValueError(f"layout {layout.mesh} has {layout.devices} devices, --devices says {args.devices}")
            est = estimate(model, layout, work, device)
            for line in explain(est, device):
                console.print(line, highlight=False, soft_wrap=True)
            if args.json:
                print(json.dumps(est.to_dict(), default=float))
            return 0
        ranking = plan(model, args.devices, work, device, args.precision)
    except ValueError as error:
        from rich.markup import escape

        console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2
    console.print(table(ranking, args.top))
    for line in explain_choice(ranking):
        console.print(line, highlight=False, soft_wrap=True)
    if ranking.best is not None:
        console.print("run it: " + run_command(args.model, ranking.best, work), highlight=False, soft_wrap=True)
        if args.write_config:
            with open(args.write_config, "w") as f:
                f.write(config_toml(args.model, ranking.best, work))
            console.print(f"wrote {args.write_config} (jaxpar train --config {args.write_config})")
    if args.png:
        for path in save_pictures(ranking, args.png):
            console.print(f"wrote {path}")
    if args.json:
        out = ranking.to_dict(args.top)
        if ranking.best is not None:
            out["command"] = run_command(args.model, ranking.best, work)
        json.dump(out, sys.stdout, default=float)
        print()
    return 0

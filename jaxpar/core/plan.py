"""The parallel plan: a mesh plus the options that decide every sharding of a step.

A Plan turns the logical names carried by a model's parameters into
PartitionSpecs for parameters, optimizer state and batches. Strategies (ZeRO,
sequence parallelism, pipelining) are options here, so switching strategy is a
configuration change, never a model change.

A Plan holds what it was given, checked; `Plan.create` converts user input
(mesh text or a user's jax Mesh, Flax-style rule pairs) into that form, and
everything derived from the options (the rules sequence parallelism adds, the
step's manual axes, the pipeline's microbatch count) is a property, so a
`dataclasses.replace` never carries a stale derivation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core import device_facts, options, trace
from jaxpar.core import rules as rules_lib
from jaxpar.core import zero_layout as zero_lib
from jaxpar.core.mesh import AXES, MeshSpec, adopt, make_mesh, mesh_shape, nesting_order


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one training step is laid out on `mesh`.

    mesh: a jax Mesh over jaxpar's axes, in the order `mesh.nesting_order` gives
        for these options (`Plan.create` arranges both).
    rules: logical name -> mesh axes (`Plan.create` takes a mapping or Flax-style
        pairs, over jaxpar.core.rules.DEFAULT_RULES); `logical_rules` adds what options imply.
    zero: 0 plain data parallelism; 1 optimizer state, 2 also gradients,
        3 also parameters sharded over `data` (jaxpar.parallel.zero). Stage 2 keeps the
        parameters sharded between steps as well and gathers each layer once
        per step; stage 3 gathers it again for the backward pass.
    zero_axes: the batch axes ZeRO shards over, `data` and/or `replica` (a
        tuple, or text "replica,data"). The default `("data",)` on a mesh
        with `replica` > 1 is HSDP: sharded within `data`, the shards
        all-reduced over `replica` (the axis that crosses hosts).
    zero_tolerance: the largest share of parameter bytes ZeRO may leave
        replicated (arrays with no dimension divisible by `data`) before it is an error.
    sequence_parallel: shard the residual stream's sequence over `tensor`.
    grad_accum: microbatches accumulated per optimizer step.
    remat: activation checkpointing per block: none, full or selective.
    precision: fp32, bf16 / fp16 compute with fp32 master weights, or bf16-params.
    tensor_form: Megatron layers as sharding annotations or as explicit shard_map (jaxpar.parallel.tensor).
    context_form: how context-parallel attention gets its keys and values: all-gather or ring (jaxpar.parallel.attention).
    attention, attention_blocks: which implementation causal attention runs (jaxpar.parallel.attention_kernels) and
        flash attention's block lengths.
    moe_kernel: which form dropless MoE layers' experts run in: buffered, tiled or ragged
        (jaxpar.parallel.expert_kernels).
    loss_chunks: the cross-entropy over this many chunks of tokens, so that one chunk's logits exist at a
        time (jaxpar.parallel.loss_chunks); 0 picks them from the logits' size.
    schedule, microbatches, virtual_stages: the pipeline over `pipe` (jaxpar.pipeline.schedule);
        microbatches=0 means one per pipeline stage (`pipeline_microbatches`).
    offload: `optimizer` keeps the optimizer state (and any fp32 master copy) in
        host memory between steps (jaxpar.parallel.offload).
    lora_rank, lora_alpha, lora_targets, lora_dropout: LoRA adapters the run puts on the model's weights
        (jaxpar.parallel.lora); only they train.
    base_dtype: with lora_rank, the frozen base held as int8 or NF4 codes (QLoRA, jaxpar.parallel.quantized_base).
    """

    mesh: Mesh
    rules: Mapping[str, rules_lib.Rule] = dataclasses.field(default_factory=lambda: dict(rules_lib.DEFAULT_RULES))
    zero: int = dataclasses.field(default=0, metadata={"help": "ZeRO stage over data: 0, 1, 2 or 3"})
    zero_axes: tuple[str, ...] = dataclasses.field(
        default=("data",), metadata={"help": "batch axes ZeRO shards over: data (HSDP when replica > 1) or replica,data"}
    )
    zero_tolerance: float = dataclasses.field(
        default=0.02, metadata={"help": "largest fraction of parameter bytes ZeRO may leave replicated"}
    )
    sequence_parallel: bool = dataclasses.field(
        default=False, metadata={"help": "shard norms and residuals along the sequence over tensor"}
    )
    grad_accum: int = dataclasses.field(default=1, metadata={"help": "microbatches accumulated per optimizer step"})
    remat: str = dataclasses.field(default="none", metadata={"help": "activation checkpointing: none, full, selective"})
    precision: str = dataclasses.field(default="fp32", metadata={"help": "fp32, bf16, fp16 or bf16-params"})
    tensor_form: str = dataclasses.field(
        default="annotation", metadata={"help": "tensor-parallel layers: annotation (XLA places collectives) or explicit"}
    )
    context_form: str = dataclasses.field(
        default="all-gather",
        metadata={"help": "context-parallel attention: all-gather (K/V gathered over context) or ring (K/V passed "
                          "around the context ranks with ppermute, online softmax)"},
    )
    attention: str = dataclasses.field(
        default="auto", metadata={"help": "attention implementation: auto (NVIDIA: cudnn where it applies, else "
                                          "flash; TPU: splash where it applies, else flash; elsewhere flash), xla "
                                          "(plain masked softmax), flash (blockwise, in XLA), cudnn, pallas "
                                          "(jaxpar's Pallas flash kernel, NVIDIA; only when asked for) or splash "
                                          "(TPU)"},
    )
    attention_blocks: str = dataclasses.field(
        default="", metadata={"help": "flash attention's (or a forced pallas/splash kernel's) query,key block "
                                      "lengths, e.g. 512,1024 (empty: the backend's)"},
    )
    moe_kernel: str = dataclasses.field(
        default="auto", metadata={"help": "dropless MoE experts: auto (TPU: ragged, else tiled), buffered (room for "
                                          "every token in every expert), tiled (sorted rows a tile at a time, memory "
                                          "of the routed rows) or ragged (sorted rows through jax.lax.ragged_dot)"},
    )
    loss_chunks: int = dataclasses.field(
        default=0, metadata={"help": "token chunks the cross-entropy is computed in, each chunk's logits recomputed "
                                     "in the backward (0: auto, chunks of at most 128 MiB of fp32 logits per device)"},
    )
    schedule: str = dataclasses.field(
        default="1f1b", metadata={"help": "pipeline schedule over pipe: gpipe, 1f1b, interleaved or zb-h1"}
    )
    microbatches: int = dataclasses.field(
        default=0, metadata={"help": "pipeline microbatches per step (0: one per pipe stage)"}
    )
    virtual_stages: int = dataclasses.field(
        default=1, metadata={"help": "layer chunks per pipe device (the interleaved schedule needs >= 2)"}
    )
    offload: str = dataclasses.field(
        default="none", metadata={"help": "keep in host memory between steps: none or optimizer (ZeRO-Offload)"}
    )
    lora_rank: int = dataclasses.field(
        default=0, metadata={"help": "train LoRA adapters of this rank beside frozen weights (0: train every weight)"}
    )
    lora_alpha: float = dataclasses.field(
        default=0.0, metadata={"help": "LoRA scale numerator: W + (alpha / rank) A B (0: alpha = rank)"}
    )
    lora_targets: tuple[str, ...] = dataclasses.field(
        default=("q", "k", "v", "o"),
        metadata={"help": "the weights LoRA adapts: q, k, v, o, gate, up, down (each expert's too), or path patterns"},
    )
    lora_dropout: float = dataclasses.field(
        default=0.0, metadata={"help": "dropout on the LoRA branch's input in training, as PEFT's lora_dropout"}
    )
    base_dtype: str = dataclasses.field(
        default="none", metadata={"help": "QLoRA, with lora_rank: hold the frozen layer-stack matrices as int8 or "
                                          "nf4 codes with a scale per 64 values, dequantized one layer at a time "
                                          "(none: in the parameter dtype)"}
    )

    def __post_init__(self):
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {self.zero!r}")
        if not 0.0 <= self.zero_tolerance <= 1.0:
            raise ValueError(f"zero_tolerance must be a fraction in [0, 1], got {self.zero_tolerance!r}")
        options.check_choice("remat", self.remat)
        options.check_choice("precision", self.precision)
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        options.check_choice("tensor_form", self.tensor_form)
        options.check_choice("context_form", self.context_form)
        options.check_choice("attention", self.attention)
        options.check_choice("moe_kernel", self.moe_kernel)
        if not isinstance(self.rules, Mapping) or "batch" not in self.rules:
            raise ValueError(f"rules must be a mapping with a 'batch' rule (Plan.create converts pairs), got {self.rules!r}")
        for name, rule in self.rules.items():
            unknown = [a for a in rules_lib.mesh_axes_of(rule) if a not in AXES]
            if unknown:
                raise ValueError(f"rule {name!r} -> {rule!r} names mesh axis {unknown[0]!r}, not one of jaxpar's "
                                 f"({', '.join(AXES)}); Plan.create(..., axis_names={{{unknown[0]!r}: ...}}) maps it")
        if set(self.mesh.axis_names) != set(AXES):
            raise ValueError(f"the plan's mesh has axes {self.mesh.axis_names}, not jaxpar's {AXES}: build it with "
                             f"Plan.create (axis_names= maps a user's axis names)")
        object.__setattr__(self, "zero_axes", self._checked_zero_axes())
        self._check_lora()
        order = nesting_order(self.mesh, manual_axes(mesh_shape(self.mesh), self.tensor_form)).axis_names
        if tuple(self.mesh.axis_names) != tuple(order):
            raise ValueError(f"the plan's mesh axes {self.mesh.axis_names} must nest as {order} (jaxpar.core.mesh); "
                             f"build the plan with Plan.create, which orders them")
        if self.loss_chunks < 0:
            raise ValueError(f"loss_chunks must be >= 1, or 0 to choose from the logits' size; got {self.loss_chunks}")
        if self.microbatches < 0:
            raise ValueError(f"microbatches must be >= 1, or 0 for one per pipe stage; got {self.microbatches}")
        options.check_plan(self)  # the pipeline schedule's counts, offload's host memory (jaxpar.core.options)
        context_ways, outer = self.shape["context"], self.axis_size(*self.rank_axes, "pipe")
        if (context_ways > 1 and self.shape["tensor"] > 1 and self.tensor_form == "annotation" and outer > 1
                and jax.__version_info__ >= (0, 12)):
            raise ValueError(
                f"context={context_ways} with tensor={self.shape['tensor']} (tensor_form='annotation') inside the "
                f"step's or the pipeline's shard_map (data x replica x pipe = {outer}) does not compile on jax "
                f"{jax.__version__}: XLA's SPMD partitioner aborts (a device-group check) on the context-parallel "
                "attention; use tensor_form='explicit', or give those devices to context"
            )
        auto_batch = [f"{a}={self.shape[a]}" for a in rules_lib.mesh_axes_of(self.rules["batch"])
                      if a not in zero_lib.AXES and self.shape.get(a, 1) > 1]
        if (self.tensor_form == "explicit" and self.shape["tensor"] > 1 and self.precision != "fp32" and auto_batch
                and device_facts.of_mesh(self.mesh).backend == "cpu"):
            raise ValueError(
                f"tensor_form='explicit' with precision={self.precision!r} and {', '.join(auto_batch)} does not compile "
                "on the CPU backend: XLA:CPU aborts ('Invalid binary instruction opcode copy') on a 16-bit "
                "tensor all-reduce while those batch axes are left to the compiler; use precision='fp32', "
                "tensor_form='annotation', or give those devices to data"
            )

    def _check_lora(self) -> None:
        """The LoRA options on their own (which weights the model has is checked where adapters are put on)."""
        targets = self.lora_targets
        targets = tuple(t.strip() for t in targets.split(",")) if isinstance(targets, str) else tuple(targets)
        object.__setattr__(self, "lora_targets", targets)
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an integer >= 0 (0: no adapters), got {self.lora_rank!r}")
        if not targets or not all(targets):
            raise ValueError(f"lora_targets must name at least one weight (q, k, v, o, gate, up, down), got "
                             f"{self.lora_targets!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.lora_dropout and self.mesh.shape.get("context", 1) > 1:
            raise ValueError(f"lora_dropout={self.lora_dropout} is not supported with context parallelism "
                             f"(context={self.mesh.shape['context']}): use 0, or give those devices to data")
        if self.lora_dropout and self.tensor_form == "explicit" and self.mesh.shape.get("tensor", 1) > 1:
            raise ValueError(f"lora_dropout={self.lora_dropout} runs its branch in the annotation form of tensor "
                             "parallelism: use tensor_form='annotation' or lora_dropout 0")
        if self.lora_rank == 0 and (self.lora_alpha or targets != ("q", "k", "v", "o")):
            raise ValueError("lora_alpha / lora_targets are set but lora_rank is 0 (no adapters): set lora_rank")
        options.check_choice("base_dtype", self.base_dtype)
        if self.base_dtype != "none" and self.lora_rank == 0:
            raise ValueError(f"base_dtype={self.base_dtype!r} (--base-dtype) quantizes the frozen base of a LoRA run, "
                             "but lora_rank is 0 (every weight trains): set lora_rank (--lora-rank)")

    def _checked_zero_axes(self) -> tuple[str, ...]:
        """`zero_axes` as a tuple in mesh order, every entry a batch axis that ZeRO can shard over."""
        given = self.zero_axes
        axes = tuple(a.strip() for a in given.split(",")) if isinstance(given, str) else tuple(given)
        for axis in axes:
            if axis not in AXES:
                raise ValueError(f"zero_axes names {axis!r}, which is not a mesh axis; ZeRO shards over "
                                 f"{' and/or '.join(zero_lib.AXES)}")
            if axis not in self.batch_axes:
                raise ValueError(f"zero_axes names {axis!r}, which is not a batch axis (the batch rule maps to "
                                 f"{', '.join(self.batch_axes) or 'nothing'}); ZeRO shards over batch axes only")
            if axis not in zero_lib.AXES:
                raise ValueError(f"zero_axes names {axis!r}: ZeRO shards over {' and/or '.join(zero_lib.AXES)}, "
                                 f"not {axis} (its ranks split other arrays)")
        if not axes or len(set(axes)) != len(axes):
            raise ValueError(f"zero_axes must name {' and/or '.join(zero_lib.AXES)} once each, got {given!r}")
        return tuple(a for a in AXES if a in axes)

    @classmethod
    def create(cls, mesh: MeshSpec | Mesh | str | None = None, devices=None, axis_names: Mapping[str, str] | None = None,
               target: str | None = None, **options: Any) -> "Plan":
        """A plan from a MeshSpec, a jax Mesh, or mesh text (`data=4,tensor=2`, a preset name).

        A jax Mesh may name its axes in the user's own way: `axis_names` maps
        them onto jaxpar's (`{"model": "tensor"}`), and each mapped name also
        becomes a logical rule, so parameters annotated with the mesh axis
        name itself (`nnx.with_partitioning(init, (None, "model"))`) shard as
        they would under Flax. `rules` may be a mapping or (logical, mesh
        axes) pairs; they override `jaxpar.core.rules.DEFAULT_RULES` name by name.
        `target` ("h100x8", "2xh100x8", a target config file: `jaxpar.core.target`) builds the mesh on that
        target's compile-only devices instead of `devices`: the step compiles for it, and nothing can run.
        """
        if target is not None:
            if devices is not None or isinstance(mesh, Mesh):
                raise ValueError(f"target={target!r} supplies the devices: give a mesh spec, not devices or a Mesh")
            from jaxpar.core import target as target_lib

            devices = target_lib.devices(target)
        preset_options: dict = {}
        if mesh is None or isinstance(mesh, str):
            from jaxpar.core.mesh import parse_mesh

            mesh, preset_options = parse_mesh(mesh)
        if isinstance(mesh, MeshSpec):
            mesh = make_mesh(mesh, devices)
        mesh = adopt(mesh, axis_names)
        fields = {f.name for f in dataclasses.fields(cls)} - {"mesh"}
        merged = {**preset_options, **options}
        unknown = set(merged) - fields
        if unknown:
            raise ValueError(f"unknown plan options {sorted(unknown)}; known: {sorted(fields)}")
        renamed = rules_lib.as_rules(dict(axis_names or {}).items())
        given = rules_lib.as_rules(merged.get("rules", {}), rename=axis_names)
        merged["rules"] = {**rules_lib.DEFAULT_RULES, **renamed, **given}
        order = manual_axes(mesh_shape(mesh), merged.get("tensor_form", "annotation"))
        return cls(mesh=nesting_order(mesh, order), **merged)

    @property
    def logical_rules(self) -> dict[str, rules_lib.Rule]:
        """The rules every spec and constraint resolves with: `rules`, plus `seq_residual` over tensor under SP.

        Under SP the residual sequence is split over its own axes (`context`)
        first and `tensor` inside them, so gathering it over `tensor` on
        entering a region leaves each context rank its own part of the sequence.
        """
        if not self.sequence_parallel:
            return dict(self.rules)
        residual = rules_lib.mesh_axes_of(self.rules.get("seq_residual"))
        return {**self.rules, "seq_residual": (*(a for a in residual if a != "tensor"), "tensor")}

    # -- sizes -------------------------------------------------------------

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches the pipeline streams per step: `microbatches`, or one per pipe stage when that is 0."""
        return self.microbatches or self.shape["pipe"]

    @property
    def shape(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    def axis_size(self, *axes: str) -> int:
        return math.prod(self.shape[a] for a in axes)

    @property
    def zero_ranks(self) -> int:
        """How many ranks ZeRO shards each array over: the product of the `zero_axes`."""
        return self.axis_size(*self.zero_axes)

    @property
    def rank_axes(self) -> tuple[str, ...]:
        """The batch axes the step's gradient path runs per rank over and sums across: `data`, and `replica` when > 1."""
        return tuple(a for a in zero_lib.AXES if a == "data" or self.shape[a] > 1)

    @property
    def step_manual_axes(self) -> tuple[str, ...]:
        """The axes the step's shard_map is manual over (see `jaxpar.train.step.loss_and_grads`).

        `replica` and `data`, whose collectives ZeRO writes out; every axis of size 1; and
        `tensor` under the explicit form, whose layers then run their own
        collectives directly instead of nesting a shard_map of their own (jax
        cannot rematerialise part of a nested one). Pipeline and MoE shard_maps
        nest inside and add `pipe` and `expert`; see `jaxpar.core.mesh`.
        """
        return manual_axes(self.shape, self.tensor_form)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return rules_lib.mesh_axes_of(self.logical_rules["batch"])

    def check_batch(self, global_batch: int, seq_len: int | None = None) -> None:
        """Raise ValueError before tracing when a batch of these sizes does not split over the plan."""
        ways = self.axis_size(*self.batch_axes) * self.grad_accum * self.pipeline_microbatches
        if global_batch % ways:
            splitting = [a for a in self.batch_axes if self.shape[a] > 1] or self.batch_axes
            raise ValueError(
                f"global batch {global_batch} does not divide by the batch axes "
                f"{', '.join(f'{a}={self.shape[a]}' for a in splitting)} x grad_accum={self.grad_accum} "
                f"x microbatches={self.pipeline_microbatches} (product {ways})"
            )
        options.check_batch(self, global_batch, seq_len)  # e.g. a sequence that splits over context
        if self.sequence_parallel and seq_len is not None:
            rules_lib.resolve_spec(("seq_residual",), (seq_len,), self.shape, self.logical_rules,
                                   path="batch sequence")

    # -- specs ---------------------------------------------------------------

    def param_specs(self, logical) -> Any:
        """PartitionSpec of every parameter from its logical names (ZeRO-2/3: also over data).

        `logical` is a tree of `jax.ShapeDtypeStruct`-like leaves each paired with
        its names: see `jaxpar.core.rules.LogicalArray`.
        """
        return self._specs(logical, over_data=self.zero >= 2)

    def optimizer_specs(self, optimizer, logical) -> Any:
        """PartitionSpec of every optimizer-state leaf: like its parameter (ZeRO-1+: over data; so is the fp32
        master that ZeRO-1 keeps there under bf16/fp16, jaxpar.train.precision)."""
        optimizer = options.wrapped_optimizer(optimizer, self)
        specs = self._specs(logical, over_data=self.zero >= 1)
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), logical, is_leaf=rules_lib.is_logical)
        abstract = jax.eval_shape(optimizer.init, shapes)
        return optax.tree_map_params(optimizer, lambda _, spec: spec, abstract, specs,
                                     transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))

    def variable_specs(self, logical) -> Any:
        """PartitionSpec of every non-parameter variable (BatchNorm statistics, ...) from its logical names."""
        return self._specs(logical, over_data=False)

    def batch_spec(self, rank: int = 2) -> P:
        return P(self.batch_axes or None, *([None] * (rank - 1)))

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def shardings(self, specs) -> Any:
        return jax.tree.map(self.sharding, specs, is_leaf=lambda x: isinstance(x, P))

    def gradient_specs(self, logical) -> Any:
        """PartitionSpec of every reduced gradient: like its parameter (ZeRO-1+: over data, like the optimizer state)."""
        return self._specs(logical, over_data=self.zero >= 1)

    def zero_report(self, logical):
        """The parameters ZeRO leaves replicated on this mesh and their share of the bytes (jaxpar.parallel.zero)."""
        return zero_lib.replicated_report(logical, self)

    def _specs(self, logical, over_data: bool) -> Any:
        def resolve(path, leaf):
            spec = rules_lib.resolve_spec(leaf.names, leaf.shape, self.shape, self.logical_rules,
                                          path=jax.tree_util.keystr(path))
            return zero_lib.add_data_axis(spec, leaf, self) if over_data else spec

        if over_data:
            zero_lib.check_replicated(self.zero_report(logical), self.zero_tolerance)
        return jax.tree.map_with_path(resolve, logical, is_leaf=rules_lib.is_logical)

    # -- tracing context -------------------------------------------------------

    def activate(self):
        """Context in which this plan is `jaxpar.core.trace.active_plan()` and its mesh jax's current mesh."""
        return trace.activate(self)


def manual_axes(shape: Mapping[str, int], tensor_form: str) -> tuple[str, ...]:
    """The step's manual axes on a mesh of this shape: `replica`, `data`, every axis of size 1, `tensor` if explicit."""
    explicit = ("tensor",) if tensor_form == "explicit" else ()
    return tuple(a for a in shape if a in zero_lib.AXES or a in explicit or shape[a] == 1)

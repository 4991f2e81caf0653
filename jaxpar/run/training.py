"""The training run behind `jaxpar train`: model, plan, data and optimizer from one config.

Everything is checked before anything compiles: the mesh against the devices,
every parameter against the plan's rules, the batch against the batch axes,
the data against the vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax
import numpy as np
import optax

from jaxpar.core import compile_cache
from jaxpar.core.timeline import mark
from jaxpar.core.plan import Plan
from jaxpar.data.stream import BatchStream, DataSpec, batch_stream
from jaxpar.interop import base_weights
from jaxpar.models import layer_pattern, model_config, model_factory
from jaxpar.parallel import attention_kernels, expert_kernels, experts, lora, offload
from jaxpar.pipeline.layer_order import to_natural_order
from jaxpar.run import preference
from jaxpar.planner import mfu as mfu_lib
from jaxpar.train.run_config import differences, run_config
from jaxpar.train.distributed import heartbeat, is_leader
from jaxpar.train.preemption import Preemption
from jaxpar.train.state import ModelDef, TrainState, describe, init_state, state_from_base
from jaxpar.train.step import Step, make_train_step

if TYPE_CHECKING:  # imported where a run opens its checkpoints: Orbax is a quarter second of every start-up
    from jaxpar.train.checkpoint import Checkpoints

NONFINITE_ACTIONS = ("skip", "stop")  # a step with a NaN/Inf loss or gradient: skip its update, or stop the run
# Settings that change which losses a run computes; a resumed run that changes one is no longer the run that saved.
TRAJECTORY = ("steps", "epochs", "batch_size", "seq_len", "lr", "warmup", "weight_decay", "clip", "seed", "data",
              "tokenizer", "text_field", "packing", "objective", "beta", "dpo_loss", "label_smoothing", "simpo_gamma",
              "sft_weight", "precompute_reference")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What to train and for how long (the plan says how it is laid out)."""

    model: str = "tiny"
    model_overrides: dict = dataclasses.field(default_factory=dict)
    steps: int = 150
    epochs: float | None = None  # the run's length in passes over the data instead (steps are derived from it)
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    data: str | None = None
    metrics: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 100
    keep: int = 3
    on_nonfinite: str = "skip"
    init_from: str | None = None  # initial parameters: import-hf output, an export or a Hugging Face directory
    adapter: str | None = None  # a PEFT LoRA adapter folder on init_from to continue training (jaxpar.interop.peft)
    eval_every: int = 0  # held-out loss every N steps (0: never); the held-out split is then not trained on
    tokenizer: str | None = None  # a tokenizer.json or SentencePiece .model for text data (default: UTF-8 bytes)
    text_field: str = "text"  # the field of a .jsonl / .parquet / datasets record that holds its text
    packing: str | None = None  # documents (whole documents per row) or windows; None: the data's default (data/packed.py)
    tensorboard: str | None = None  # also write the metrics as TensorBoard scalars into this directory
    peak_flops: float | None = None  # FLOP/s of one device for MFU, where jaxpar.planner.devices' table does not know it
    skip_bad_records: bool = False  # train without a document source's bad records instead of refusing the source
    compile_cache: str | None = None  # compiled steps kept here (or "off"); None: jaxpar.core.compile_cache's default
    objective: str | None = None  # dpo, simpo, orpo (jaxpar.objectives); None: next-token cross-entropy
    beta: float | None = None  # the objective's beta (None: its default, jaxpar.objectives.preference.DEFAULT_BETA)
    dpo_loss: str = "sigmoid"  # sigmoid, ipo, hinge, robust
    label_smoothing: float = 0.0  # robust DPO's chance of a flipped label; SimPO's label smoothing
    simpo_gamma: float = 0.5  # SimPO's target margin
    sft_weight: float = 0.0  # SimPO: the chosen answers' cross-entropy added with this weight (CPO's cpo_alpha)
    precompute_reference: bool = False  # DPO: the reference's log-probs computed once and carried with the data

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "save_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.epochs is not None and not 0 < self.epochs < float("inf"):
            raise ValueError(f"epochs must be > 0 and finite (passes over the data, e.g. 1 or 2.5), got {self.epochs}")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_ACTIONS}, got {self.on_nonfinite!r}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: no evaluation), got {self.eval_every}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0 (FLOP/s of one device, e.g. 989e12), got {self.peak_flops}")


def learning_rate(config: TrainConfig) -> optax.Schedule:
    """Linear warm-up to `lr`, then cosine decay to lr/10 at the last step; the update of step t uses lr(t)."""
    warmup = min(config.warmup, config.steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(config.steps, warmup + 1),
                                              end_value=config.lr / 10)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW on `learning_rate(config)` with global-norm clipping; no decay where `decayed` says so."""
    return optax.chain(optax.clip_by_global_norm(config.clip),
                       optax.adamw(learning_rate(config), weight_decay=config.weight_decay, mask=decayed))


def decayed(params):
    """Whether each parameter decays: not DeepSeek-V3's router correction, which has no gradient by design (it acts
    on the experts' choice only) and which the decay alone would move towards 0."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(key, "key", None) == experts.CORRECTION for key in path), params)


@dataclasses.dataclass
class Run:
    """A prepared run: everything built and checked, nothing compiled yet."""

    config: TrainConfig
    plan: Plan
    model_config: Any
    model: ModelDef
    optimizer: optax.GradientTransformation
    data: BatchStream  # the run's global batches, and what --eval-every holds out (data.heldout)
    make_model: Callable
    step_fn: Step
    mfu: mfu_lib.Mfu
    hf_config: dict | None = None  # the Hugging Face config.json --init-from's weights came from, for export
    base: dict | None = None  # a LoRA run's --init-from path and fingerprint (jaxpar.interop.base_weights)
    adapter: dict | None = None  # --adapter's A and B in the parameter tree's layout, to start from

    @property
    def batches(self):
        """The indexable batches under the stream (epochs, row counts, the report's figures)."""
        return self.data.batches

    @batches.setter
    def batches(self, batches) -> None:
        self.data.batches = batches

    @property
    def heldout(self):
        """What --eval-every evaluates, never trained on: tokens, a DocumentSource, or a mixture's HeldOut list."""
        return self.data.heldout

    @property
    def batch_sharding(self):
        return self.data.sharding

    def init(self) -> TrainState:
        if self.config.init_from and self.plan.lora_rank:  # the weights read are the base; adapters added here
            from jaxpar.interop.saved_weights import load_params

            base = describe(model_factory(self.config.model, self.model_config, self.config.seed))
            params = _joined(load_params(self.config.init_from, base, self.plan), self.adapter or {})
            return state_from_base(params, self.make_model, self.model, self.optimizer, self.plan)
        if self.config.init_from:
            from jaxpar.interop.saved_weights import initial_state

            return initial_state(self.config.init_from, self.model, self.optimizer, self.plan)
        return init_state(self.make_model, self.optimizer, self.plan, lora.trainable_for(self.plan))[1]

    def batch(self, step: int) -> dict[str, jax.Array]:
        return self.data.batch(step)


def _joined(params: dict, adapters: dict) -> dict:
    """The base parameters with the adapters' entries added beside their weights."""
    out = {k: _joined(v, adapters[k]) if isinstance(v, dict) and k in adapters else v for k, v in params.items()}
    return {**out, **{k: v for k, v in adapters.items() if k not in params}}


def data_spec(config: TrainConfig) -> DataSpec:
    """What the run's config says about its data."""
    return DataSpec(config.data, config.tokenizer, config.text_field, config.packing, config.epochs is not None,
                    bool(config.eval_every), config.seed, config.skip_bad_records)


def _learn_counts_from_newest(stream: BatchStream, directory) -> None:
    """The counts of the newest readable checkpoint in `directory`, if any (a damaged one is left to `resume`)."""
    if not hasattr(stream.batches, "learn_saved_counts") or not Path(directory).is_dir():
        return
    from jaxpar.train.checkpoint import Checkpoints, CorruptCheckpoint

    try:
        checkpoints = Checkpoints(directory, read_only=True)
    except ValueError:  # no complete checkpoint yet
        return
    try:
        meta = checkpoints.metadata()
    except (CorruptCheckpoint, ValueError):
        return
    finally:
        checkpoints.close()
    if meta.get("data", {}).get("order") == stream.get_state()["order"]:
        stream.learn_counts(meta["data"], _origin(meta, checkpoints.directory))


def _origin(meta: dict, directory) -> str:
    return f"the checkpoint of step {meta.get('step')} in {directory}"


def _with_epoch_steps(config: TrainConfig, batches) -> TrainConfig:
    """`config` with `steps` derived from `epochs` (every later use, the learning-rate schedule first, reads it)."""
    if config.epochs is None:
        return config
    steps = batches.steps_for(config.epochs)
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "steps")
    if config.steps not in (default, steps):
        raise ValueError(f"steps={config.steps} and epochs={config.epochs} both set the run's length; give one "
                         f"(epochs={config.epochs} is {steps} steps here)")
    return dataclasses.replace(config, steps=steps)


def prepare(config: TrainConfig, plan: Plan) -> Run:
    """Build and check everything a run needs; raises ValueError on any bad input."""
    compile_cache.use(config.compile_cache)
    name, saved, hf_config = config.model, {}, None
    if config.init_from:  # the model is the one the weights belong to; [model] fields may still override
        from jaxpar.interop.hf import saved_hf_config, saved_model_config

        name, saved_config = saved_model_config(config.init_from)
        saved, hf_config = dataclasses.asdict(saved_config), saved_hf_config(config.init_from)
        if config.model not in (TrainConfig.model, name):
            raise ValueError(f"--model {config.model} and --init-from {config.init_from} name different models; "
                             "the weights decide the model: drop --model")
        config = dataclasses.replace(config, model=name)  # what the run config saved with each checkpoint names
    mcfg = model_config(name, {**saved, "seq_len": config.seq_len, **config.model_overrides})
    if config.adapter and not (config.init_from and plan.lora_rank):
        raise ValueError(f"--adapter {config.adapter} needs --init-from BASE and the adapter's LoRA options (the "
                         "command line sets them from its adapter_config.json)")
    adapter = None
    if config.adapter:  # read (it is small) and checked against the base before anything compiles
        from jaxpar.interop.peft import read_adapter

        adapter = read_adapter(config.adapter, mcfg, config.init_from)
    plan.check_batch(config.batch_size)
    attention_kernels.check_forced(plan)  # a forced cuDNN that no call could get: one line, before any compile
    make_model, trainable = lora.for_plan(model_factory(name, mcfg, config.seed), plan)  # --lora-rank's adapters
    model = describe(make_model, trainable)
    plan.param_specs(model.logical)  # divisibility of every parameter, before any compile
    layer_pattern.check_pipeline_chunks(mcfg, plan.shape["pipe"], plan.virtual_stages)  # Gemma 2's pairs
    expert_kernels.check_model(getattr(mcfg, "n_experts", 0), getattr(mcfg, "dropless", False), plan, name)
    if config.eval_every:
        from jaxpar.run.evaluate import check_evaluable

        check_evaluable(name, mcfg)
    objective = preference.objective_of(config, plan) if config.objective else None
    if objective is not None:
        data = preference.preference_stream(config, plan, objective)
    else:
        data = batch_stream(data_spec(config), plan, config.batch_size, config.seq_len, mcfg.vocab, is_leader())
    if config.epochs is not None and config.checkpoint_dir:  # counts saved earlier spare tokenizing for the length
        _learn_counts_from_newest(data, config.checkpoint_dir)
    config = _with_epoch_steps(config, data.batches)
    optimizer = make_optimizer(config)
    step_fn = make_train_step(model, objective or (lambda module, batch: module(batch)), optimizer, plan)
    mfu = mfu_lib.for_run(name, mcfg, config.batch_size, config.seq_len, plan.precision,
                          list(plan.mesh.devices.flat), config.peak_flops)
    base = base_weights.record(config.init_from) if plan.lora_rank else None
    mark("prepared")
    return Run(config, plan, mcfg, model, optimizer, data, make_model, step_fn, mfu, hf_config, base, adapter)


def scalar_metrics(metrics: dict) -> dict[str, Any]:
    """Metrics as JSON-ready values: scalars as floats, small arrays as lists."""
    out = {}
    for key, value in jax.device_get(metrics).items():
        value = np.asarray(value)
        out[key] = float(value) if value.ndim == 0 else value.tolist()
    return out


def device_memory() -> dict[str, int]:
    """Bytes in use and their peak on the fullest local device, where the backend reports them (not XLA:CPU)."""
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
    out = {}
    for key in ("bytes_in_use", "peak_bytes_in_use"):
        if any(key in s for s in stats):
            out["memory_" + key] = max(int(s.get(key, 0)) for s in stats)
    return out


def open_checkpoints(run: Run) -> Checkpoints | None:
    """The run's checkpoint directory (None without one); raises ValueError if it holds another model's."""
    config = run.config
    if not config.checkpoint_dir:
        return None
    from jaxpar.train.checkpoint import Checkpoints

    return Checkpoints(config.checkpoint_dir, save_every=config.save_every, keep=config.keep,
                       config={**run_config(config, run.model_config, run.plan, run.hf_config),
                               **({base_weights.KEY: run.base} if run.base else {})})


def resume(run: Run, checkpoints: Checkpoints | None) -> tuple[TrainState, dict]:
    """The newest intact checkpoint's state laid out for this run's plan (or a fresh state), and where it stands.

    The position is the saved metadata (`step`, `nonfinite_steps`, `config`, ...),
    or step 0 for a fresh start. Newer steps that are damaged are said so on
    stderr and renamed out of the way (`Checkpoints.set_aside`), never deleted;
    if every step is damaged, ValueError lists them and nothing is moved. A
    checkpoint whose data order differs from this run's is refused before its
    arrays are read (`BatchStream.set_state`), which then stands at the checkpoint's step.
    """
    if checkpoints is None or checkpoints.latest_step() is None:
        return run.init(), {"step": 0, "nonfinite_steps": 0}
    from jaxpar.train.checkpoint import CorruptCheckpoint

    damaged = []
    for step in reversed(checkpoints.steps()):
        try:
            meta = checkpoints.metadata(step)
            base_weights.check(meta.get("config"), f"checkpoint step {step} in {checkpoints.directory}")
            run.data.set_state({"position": meta.get("step", step), **meta.get("data", {})},
                               _origin(meta, checkpoints.directory))
            restored = checkpoints.restore(run.model, run.optimizer, run.plan, step)
        except CorruptCheckpoint as error:
            damaged.append(error)
            continue
        for error in damaged:
            kept = checkpoints.set_aside(error.step)
            if is_leader():
                print(f"warning: {error}\n  kept it as {kept}; resuming from step {step}, the newest intact checkpoint",
                      file=sys.stderr, flush=True)
        return restored
    steps = ", ".join(str(error.step) for error in damaged)
    raise ValueError("\n".join([f"no intact checkpoint in {checkpoints.directory} (damaged steps: {steps}); nothing was "
                                f"moved or deleted. Use another --checkpoint-dir to start afresh.", *map(str, damaged)]))


def changed_settings(position: dict, run: Run) -> list[str]:
    """Train settings that differ from the ones the resumed checkpoint was saved with (see TRAJECTORY)."""
    if not position.get("config"):
        return []
    saved, current = position["config"]["train"], run_config(run.config, run.model_config, run.plan)["train"]
    default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # what an older checkpoint lacks
    return differences({k: saved.get(k, default[k]) for k in TRAJECTORY}, {k: current[k] for k in TRAJECTORY})


# Settings that only say where a run's outputs go: they never change the compiled step, so they stay out of its key.
OUTPUT_SETTINGS = ("metrics", "tensorboard", "checkpoint_dir", "save_every", "keep", "compile_cache", "peak_flops")


def compiled_step(run: Run, state: TrainState, start: int):
    """The step compiled ahead, or loaded whole from the compile cache when this exact run compiled it before
    (jaxpar.core.executables: no tracing, no lowering); with several processes they then wait for each other.

    On CPU each new group of processes sets up its collectives when it first
    meets, and gives up after XLA's fixed 30 s; processes compiling at different
    speeds (a loaded host) would reach the first step further apart than that.
    """
    from jaxpar.core import executables, usage

    mark("step: compile begins")
    batch = run.batch(start)
    settings = {k: v for k, v in dataclasses.asdict(run.config).items() if k not in OUTPUT_SETTINGS}
    key = executables.key({"plan": run.plan, "model": run.model_config, "train": settings, "base": run.base},
                          (state, batch))
    loaded = executables.load(compile_cache.directory(), key, (state, batch))
    if loaded is not None:
        compiled, run.step_fn.used = loaded
        usage.check(run.plan, run.step_fn.used)  # its warnings again, as tracing gave them
        compile_cache.loaded_whole()
    else:
        compiled = run.step_fn.lower(state, batch).compile()
        executables.store(compile_cache.directory(), key, compiled, run.step_fn.used)
    mark("step: compiled")
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp

        # The coordination service's barrier, not a collective (which would itself have the 30 s limit).
        ocp.multihost.get_barrier_sync_fn()(key="jaxpar-step-compiled", timeout_ms=30 * 60 * 1000)
        mark("step: barrier passed")
    return compiled


def iterate(run: Run, state: TrainState, start: int = 0, checkpoints: Checkpoints | None = None,
            nonfinite_steps: int = 0) -> Iterator[tuple[TrainState, dict]]:
    """Train from step `start` to `config.steps`, yielding the state and metrics of each step.

    With `checkpoints`, saves every `save_every` steps and at the end. SIGTERM
    ends the run after the current step, saved (the last row says
    `preempted`). A step whose loss or gradient is not finite keeps the old
    parameters (see jaxpar.train.step) and is counted in `nonfinite_steps`; under
    `on_nonfinite="stop"` it raises FloatingPointError instead. Rows carry the
    step's learning rate, MFU where it is meaningful (jaxpar.planner.mfu) and device
    memory where the backend reports it; process 0 writes them to `--metrics`
    and `--tensorboard`.
    """
    config = run.config
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # once, on this host: no accelerator work per step
        lrs = np.asarray(jax.jit(jax.vmap(learning_rate(config)))(np.arange(config.steps)))  # eager: 1.5 s of ops
    outputs = Outputs(config.metrics, config.tensorboard, start)
    evaluator = _evaluator(run)
    if config.precompute_reference and start < config.steps:
        preference.precompute_reference(run)
    ahead = start < config.steps and (jax.process_count() > 1 or isinstance(run.step_fn, Step))  # a Step, not a stand-in
    step_fn = compiled_step(run, state, start) if ahead else run.step_fn
    run.data.seek(start, config.steps)
    try:
        with Preemption() as preemption:
            for step, batch in zip(range(start, config.steps), run.data):
                began = time.perf_counter()
                state, metrics = step_fn(state, batch)
                row = scalar_metrics(metrics)
                elapsed = time.perf_counter() - began
                done = step + 1
                heartbeat(done)  # under `jaxpar launch`: its mtime tells the launcher this rank is not hung
                nonfinite_steps += int(row.get("nonfinite", 0))
                row = _step_row(run, row, done, elapsed, float(lrs[step]), nonfinite_steps)
                preempted = preemption.reached(done)
                if checkpoints is not None:
                    row["saved"] = _save(run, checkpoints, state, done, nonfinite_steps,
                                         force=preempted or done == config.steps)
                if preempted:
                    row["preempted"] = True
                if evaluator is not None and (done % config.eval_every == 0 or done == config.steps):
                    row.update(evaluator(to_natural_order(offload.fetched(state.params), run.model.logical, run.plan)))
                outputs.write(row)
                yield state, row
                if preempted:
                    break
    finally:
        run.data.close()  # stops the read-ahead of a run that ended early
        if checkpoints is not None:
            checkpoints.wait()
        outputs.close()


def _step_row(run: Run, row: dict, done: int, elapsed: float, lr: float, nonfinite_steps: int) -> dict:
    """The progress row of step `done` from its scalar metrics; FloatingPointError for a non-finite step under
    `on_nonfinite="stop"`."""
    config = run.config
    row = {"step": done, **row, "lr": lr, "nonfinite_steps": nonfinite_steps,
           **({"epoch": run.batches.epoch_of(done)} if hasattr(run.batches, "epoch_of") else {}),
           **({f"epoch/{n}": e for n, e in run.batches.source_epochs(done).items()}
              if hasattr(run.batches, "source_epochs") else {}),
           "step_time_s": elapsed, "tokens_per_s": config.batch_size * config.seq_len / elapsed, **device_memory()}
    mfu = run.mfu(elapsed)
    if mfu is not None:
        row["mfu"] = mfu
    if row.get("nonfinite") and config.on_nonfinite == "stop":
        raise FloatingPointError(
            f"step {done}: loss {row['loss']}, gradient norm {row.get('grad_norm')}; stopping "
            f"(on_nonfinite='stop'), parameters left as after step {done - 1}"
        )
    return row


def _save(run: Run, checkpoints: Checkpoints, state: TrainState, done: int, nonfinite_steps: int, force: bool):
    """Save after step `done` if it is due (or `force`), with the data and RNG position a resume needs."""
    data = run.data.get_state()  # the stream has given the batches of steps < done
    drawn_by = data.pop("drawn_by")
    position = {"nonfinite_steps": nonfinite_steps, "data": data, "rng": {"seed": run.config.seed, "batches": drawn_by}}
    return checkpoints.save(done, state, force=force, metadata=position, model=run.model, optimizer=run.optimizer,
                            plan=run.plan)


def _evaluator(run: Run):
    """The held-out evaluation `--eval-every` asks for, or None."""
    if not run.config.eval_every:
        return None
    from jaxpar.data.holdout import held_out_batches
    from jaxpar.run.evaluate import Evaluator, MixtureEvaluator

    held, seq_len, batch_size = run.heldout, run.config.seq_len, run.config.batch_size
    if isinstance(held, list):  # a mixture: each source's held-out data
        return MixtureEvaluator(run.model, run.plan, held, seq_len, batch_size)
    return Evaluator(run.model, run.plan, held_out_batches(held, seq_len, batch_size), batch_size)


class Outputs:
    """Where process 0 writes every row: `metrics` (JSON lines, `--metrics`) and `tensorboard` (`--tensorboard`).

    A run resumed from step `start` first drops the metrics rows of later steps (written after the checkpoint it
    resumes from, before the run was stopped) and a row cut short by a kill, so the file holds each step once.
    """

    def __init__(self, metrics: str | Path | None, tensorboard: str | Path | None, start: int = 0):
        self.file = None
        if metrics and is_leader():
            keep_rows_through(Path(metrics), start)
            self.file = Path(metrics).open("a")
        self.board = None
        if tensorboard and is_leader():
            from jaxpar.run.tensorboard import TensorBoard

            self.board = TensorBoard(tensorboard)

    def write(self, row: dict) -> None:
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.board:
            self.board.write(row)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.board:
            self.board.close()


def keep_rows_through(path: Path, step: int) -> None:
    """Rewrite the metrics file `path` (if any) to its whole rows of steps <= `step`, the rows a resume keeps."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the row a kill cut short
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept), encoding="utf-8")
    partial.replace(path)


def param_table(run: Run) -> list[dict]:
    """One row per parameter: path, shape, logical names, PartitionSpec, bytes per device."""
    specs = run.plan.param_specs(run.model.logical)
    rows = []
    for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(run.model.logical, is_leaf=lambda x: hasattr(x, "names"))[0],
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
    ):
        axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        rows.append({
            "path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "logical": list(leaf.names),
            "spec": str(spec), "bytes_per_device": leaf.nbytes // run.plan.axis_size(*axes),
        })
    return rows

"""Sharded Orbax checkpoints: async saves every N steps, the newest K kept, restore onto any plan.

A checkpoint is one Orbax step directory with up to four items: `params`,
`opt_state` and `variables` (the model's non-parameter state: BatchNorm
statistics, counters), each array written shard by shard by the devices that
hold it (TensorStore/OCDBT, no pickle), and `meta`, readable JSON with the step (which
is also the data position: batches are a pure function of (seed, step)), the
seeds, and the run's config (model, mesh, plan, train). Orbax writes a step
into a temporary directory and renames it once every shard is on disk, so a
crash in the middle of a save leaves the previous checkpoints intact; the
half-written directory is removed the next time the directory is opened.

Restoring reads every shard straight into the devices that hold it under the
target plan (its `abstract_state`), whatever mesh and ZeRO stage wrote it.
Checkpoints hold the stacked layers in natural order, whatever order the
saving plan kept them in (jaxpar.pipeline.layer_order), so they restore onto any plan
and export as they are.

Orbax's files carry no checksum of the array values (a flipped byte in a data
file restores silently), so `meta` also holds a 32-bit checksum of every array,
computed on the devices at save time and again after each restore; a step that
fails it, or whose files cannot be read, raises `CorruptCheckpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxpar.core.plan import Plan
from jaxpar.core.spelling import name as option_name
from jaxpar.parallel import offload
from jaxpar.pipeline import layer_order
from jaxpar.train import precision
from jaxpar.train.checksums import checksums, listing, mismatches, structure_difference
from jaxpar.train.orbax_noise import quiet_orbax
from jaxpar.train.rank_report import tell_checkpoints
from jaxpar.train.run_config import model_changes
from jaxpar.train.state import ModelDef, TrainState, abstract_state

FORMAT = "jaxpar-checkpoint/1"
ARRAY_ITEMS = ("params", "opt_state", "variables")
TEMPORARY = ".orbax-checkpoint-tmp"  # how Orbax marks a step directory still being written
# bf16/fp16 checkpoints of ZeRO-1 (and older ones of every stage) hold 2-byte `params` and the fp32 parameters
# here in the optimizer state ({master, inner, loss_scale}, jaxpar.train.precision.MasterState); those of the other
# stages hold fp32 `params` once. Either restores onto either layout from its fp32 values, and exports them.
MASTER = "master"
CHECKSUMS = "checksums"  # meta key: `item/path` -> checksum of each saved array (see `checksums`)
SET_ASIDE = ".corrupted"  # suffix of a damaged step directory that a training run moved out of its way
STRUCTURE_ERROR = "tree structures do not match"  # Orbax's words for a target whose containers differ
READ_ERRORS = (ValueError, OSError, KeyError, RuntimeError, TypeError, EOFError)  # what damaged files raise


class CorruptCheckpoint(ValueError):
    """A saved step whose files cannot be read or whose arrays differ from the checksums saved with them."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


def _type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's array handler, without replica-parallel writes when one process writes everything.

    Replica-parallel saving splits each replicated array among its replicas with
    an eager slice per array shape (~0.1 s of compiling each on CPU), which buys
    nothing when a single process writes all the shards anyway.
    """
    replica_parallel = None if jax.process_count() > 1 else False
    return ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
    )


def _where_they_lie(convert, state: TrainState, compiled: dict) -> TrainState:
    """`convert(state)` computed where its arrays are, each result sharded (and in the memory) as its input.

    Arrays kept in host memory (jaxpar.parallel.offload) visit the device for it, as they do for every step's update.
    `compiled` keeps the jitted `convert` per layout of `state`, so that a run saving every few steps
    compiles it once.
    """
    shardings = jax.tree.map(lambda x: x.sharding, state)
    leaves, treedef = jax.tree.flatten(shardings)
    key = (treedef, tuple(leaves))
    if key not in compiled:
        compiled[key] = jax.jit(convert, out_shardings=shardings)
    return compiled[key](offload.fetched(state))


def _filled(state: TrainState) -> list[str]:
    """The array items that hold arrays (Orbax refuses an empty tree, e.g. plain SGD's optimizer state)."""
    return [item for item in ARRAY_ITEMS if jax.tree.leaves(getattr(state, item))]


_OPEN: weakref.WeakSet = weakref.WeakSet()  # the directories not yet closed, finished at interpreter exit


def _finish_open_ones(at_exit: bool = False) -> None:
    """Finish the saves in flight of every directory left open (a loop that never closed it, or Ctrl-C).

    A `save` that returned is a promise: left to interpreter exit, Orbax's commit finds Python's thread pools shut
    ("cannot schedule new futures after shutdown") and leaves the step half-written. An uncaught exception (Ctrl-C's
    KeyboardInterrupt too) finishes them before Python starts shutting down; a script's plain end does so in
    threading's exit hooks, which run before the pools shut, except on Python >= 3.12, where no thread may start
    by then: those saves are abandoned, said so. A second Ctrl-C while finishing abandons what is pending too.
    Abandoned saves leave no half-written directory."""
    for directory in list(_OPEN):
        if at_exit and sys.version_info >= (3, 12):
            # the commit threads' own failures (Orbax's, through absl), which the line below replaces
            logging.getLogger("absl").addFilter(lambda record: record.levelno < logging.ERROR)
            with contextlib.suppress(Exception):
                directory.wait()  # until the commit thread has failed: then nothing writes into what is removed
            if directory.abandon():
                print(f"warning: Checkpoints(directory={str(directory.directory)!r}) was left open at exit: its save "
                      "in flight could not finish (Python >= 3.12 starts no thread at exit) and was removed; close "
                      "it (`with Checkpoints(...)`, or close() in a finally)", file=sys.stderr, flush=True)
            continue
        try:
            directory.wait()
            directory.close()
        except KeyboardInterrupt:
            directory.abandon()
            print(f"warning: interrupted while finishing the checkpoint saves in flight in {directory.directory}; "
                  "the unfinished ones were removed", file=sys.stderr, flush=True)


@functools.cache
def _finish_open_ones_at_exit() -> None:
    """Install `_finish_open_ones` in the excepthook (before shutdown starts) and in threading's exit hooks, where it
    runs before concurrent.futures' own (registered at its import, which Orbax's import did: they run last
    registered first). `atexit` would run after it: too late."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        previous(kind, value, traceback)
        _finish_open_ones()

    sys.excepthook = excepthook
    threading._register_atexit(functools.partial(_finish_open_ones, at_exit=True))  # noqa: SLF001


class Checkpoints:
    """A run's checkpoint directory: async saves every `save_every` steps, the newest `keep` kept.

    `config` (see `run_config`) is saved with every step; opening a directory
    whose checkpoints hold a different model raises ValueError, so one run
    never overwrites another model's checkpoints. `read_only` opens an
    existing directory for restoring or exporting and never deletes anything.
    """

    def __init__(self, directory, *, save_every: int = 1, keep: int | None = None, config: dict | None = None,
                 async_save: bool = True, read_only: bool = False):
        quiet_orbax()
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} is a file")
        if read_only and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {str(self.directory)!r} does not exist")
        if save_every < 1 or (keep is not None and keep < 1):
            raise ValueError(f"save_every and keep must be >= 1, got save_every={save_every}, keep={keep}")
        self.config = config
        self.save_every = save_every
        self._reorders: dict = {}
        if not read_only:
            self._remove_half_written()
            tell_checkpoints(self.directory)  # under `jaxpar launch`: its reports and restarts name our last one
        handler = lambda: ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers())  # noqa: E731
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=0 if read_only else 1,  # `save` decides itself and forces; 0 keeps read-only quiet
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=async_save,
            read_only=read_only,
            create=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={**{item: handler() for item in ARRAY_ITEMS}, "meta": ocp.JsonCheckpointHandler()},
        )
        self.read_only = read_only
        if not read_only:
            _finish_open_ones_at_exit()
            _OPEN.add(self)
        try:
            if read_only and self.latest_step() is None:
                raise ValueError(f"checkpoint directory {str(self.directory)!r} holds no complete checkpoint")
            if config is not None:
                self._check_same_model(config)
        except ValueError:
            self.close()
            raise

    def _check_same_model(self, config: dict) -> None:
        """Refuse a directory whose checkpoints hold another model, judged by the newest readable step.

        Without a saved config, restore checks shapes; a damaged step is left to restore to report.
        """
        for step in reversed(self.steps()):
            try:
                saved = self.metadata(step)["config"]
            except CorruptCheckpoint:
                continue
            break
        else:
            return
        if saved is None:
            return
        changed = model_changes(saved["model"], config["model"])
        if changed:
            raise ValueError(
                f"{self.directory} holds checkpoints of another model (step {step}); refusing to "
                f"overwrite them. Differences: {'; '.join(changed)}. Use another {option_name('checkpoint_dir')}."
            )

    def _remove_half_written(self) -> bool:
        """Delete the steps a crash left half-written, now rather than in Orbax's background sweep.

        One process deletes; the others reach their first save only after every
        process has passed Orbax's barrier at the start of a save.
        """
        if jax.process_index() != 0 or not self.directory.is_dir():
            return False
        removed = False
        for path in self.directory.iterdir():
            if TEMPORARY in path.name and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
                removed = True
        return removed

    # -- what is there --------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def metadata(self, step: int | None = None) -> dict:
        """The JSON saved with `step` (default the newest): step, data position, seeds, config."""
        step = self.resolve_step(step)
        meta = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"step {step} in {self.directory} is not a jaxpar checkpoint (no {FORMAT} metadata)")
        return meta

    def resolve_step(self, step: int | None = None) -> int:
        """`step` if saved complete, else ValueError listing the saved steps; None: the newest."""
        steps = self.steps()
        if not steps:
            raise ValueError(f"checkpoint directory {str(self.directory)!r} holds no complete checkpoint")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no checkpoint of step {step} in {self.directory}; saved steps: {steps}")
        return step

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Turn Orbax's and TensorStore's many errors on damaged files into one CorruptCheckpoint naming the step."""
        try:
            yield
        except CorruptCheckpoint:
            raise
        except Exception as error:
            if not isinstance(error, READ_ERRORS) and type(error) is not Exception:  # Orbax raises bare Exception
                raise
            root = error
            while root.__cause__ is not None:
                root = root.__cause__
            cause = str(root).split(" [tensorstore_spec=")[0]
            raise CorruptCheckpoint(
                step, f"checkpoint step {step} in {self.directory} is unreadable ({type(root).__name__}: {cause})"
            ) from error

    def _verify(self, step: int, meta: dict, arrays: dict) -> None:
        """Raise CorruptCheckpoint naming every restored array whose checksum differs from the saved one.

        Checkpoints written before checksums existed carry none and pass unverified.
        """
        saved = meta.get(CHECKSUMS) or {}
        restored = checksums(arrays) if saved else {}
        wrong = [path for path, value in restored.items() if path in saved and saved[path] != value]
        if wrong:
            raise CorruptCheckpoint(
                step, f"checkpoint step {step} in {self.directory} is corrupted: {len(wrong)} of {len(restored)} "
                f"arrays differ from the checksums written when it was saved:{listing(wrong)}"
            )

    def set_aside(self, step: int) -> Path:
        """Rename a damaged step's directory to `<step>.corrupted`: kept for inspection, no longer a step.

        So the run that falls back past it can save that step number again.
        """
        if self.read_only:
            raise ValueError(f"{self.directory} is opened read-only; not moving step {step}")
        source = self.directory / str(step)
        target, n = source.with_name(f"{step}{SET_ASIDE}"), 1
        while target.exists():
            target, n = source.with_name(f"{step}{SET_ASIDE}.{n}"), n + 1
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jaxpar-set-aside-{step}")
        self._manager.reload()
        return target

    def read_arrays(self, step: int | None, trees: dict, partial: bool = False) -> dict:
        """{item: tree} of the arrays saved at `step` (None: the newest), each read straight into the shards of
        `trees` ({item: a tree of jax.ShapeDtypeStruct with shardings, or numpy arrays' shapes}); `partial`: the
        trees may hold only some of an item's arrays. What export and `jaxpar generate` read a checkpoint with;
        unverified (the checksums cover whole items: `restore` checks them). Damaged files: CorruptCheckpoint."""
        step = self.resolve_step(step)
        reads = {item: ocp.args.PyTreeRestore(tree, partial_restore=partial,
                                              restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
                 for item, tree in trees.items()}
        restored = self._read(step, ocp.args.Composite(**reads))
        return {item: restored[item] for item in reads}

    def _read(self, step: int, args: ocp.args.Composite):
        with self._reading(step):
            return self._manager.restore(step, args=args)

    def saved_arrays(self, step: int | None, item: str):
        """An array item as saved at `step` (None: the newest), without reading it: a tree of Orbax's ArrayMetadata
        (shape, dtype, and the file it lies in: `directory`, `name`); {} if the step has none (an empty optimizer
        state)."""
        step = self.resolve_step(step)
        with self._reading(step):
            saved = self._manager.item_metadata(step).get(item)
        return {} if saved is None else saved.tree

    # -- save and restore -----------------------------------------------------------

    def save(self, step: int, state: TrainState, *, force: bool = False, metadata: dict | None = None,
             model: ModelDef | None = None, optimizer: optax.GradientTransformation | None = None,
             plan: Plan | None = None) -> bool:
        """Start saving `state` as `step` if it is a multiple of `save_every` (or `force`); True if started.

        Waits for the previous save to commit, then returns once the arrays are
        copied off the devices (so the next step may donate them); the write to
        disk and the commit finish in the background. The stacked layers are
        written in natural order: a state held by a plan that keeps them in
        pipeline order (jaxpar.pipeline.layer_order) needs its `model`, `optimizer` and `plan`.
        """
        if not force and step % self.save_every:
            return False
        state = self._natural_order(state, model, optimizer, plan)
        trees = {item: getattr(state, item) for item in _filled(state)}
        meta = {"format": FORMAT, "step": step, "config": self.config, CHECKSUMS: checksums(trees), **(metadata or {})}
        arrays = {item: ocp.args.PyTreeSave(tree) for item, tree in trees.items()}
        return self._manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **arrays), force=True)

    def _natural_order(self, state: TrainState, model, optimizer, plan) -> TrainState:
        """`state` with its stacked layers in natural order, converted where they lie (a copy of those arrays)."""
        if plan is None:
            config = self.config or {}
            if config.get("plan", {}).get("virtual_stages", 1) > 1 and config.get("mesh", {}).get("pipe", 1) > 1:
                raise ValueError("this run's plan keeps the stacked layers in pipeline order (virtual_stages > 1): "
                                 "pass save(..., model=, optimizer=, plan=) so that they are written in natural order")
            return state
        if not layer_order.reorders(plan):
            return state
        if model is None or optimizer is None:
            raise ValueError(f"plan with pipe={plan.shape['pipe']} x virtual_stages={plan.virtual_stages} keeps the "
                             "stacked layers in pipeline order: save needs the state's model and optimizer too")
        return self._reordered(state, model, optimizer, plan, to_natural=True)

    def _reordered(self, state: TrainState, model, optimizer, plan, to_natural: bool) -> TrainState:
        """`state` between natural and `plan`'s layer order, converted where it lies; the conversion is
        traced and compiled once per (model, optimizer, plan, direction), then reused at every save."""
        key = (id(model), id(optimizer), id(plan), to_natural)
        if key not in self._reorders:
            reorder = layer_order.state_to_natural_order if to_natural else layer_order.state_to_pipeline_order
            # the objects ride along so that their ids are not reused while the entry lives
            self._reorders[key] = (lambda s: reorder(s, model.logical, optimizer, plan, model.trained(model.logical)), {},
                                   (model, optimizer, plan))
        convert, compiled, _ = self._reorders[key]
        return _where_they_lie(convert, state, compiled)

    def check_fits(self, target: TrainState, step: int | None = None) -> None:
        """Raise ValueError naming every array whose path, shape or dtype differs from the target state's."""
        step = self.resolve_step(step)
        self._refuse_misfit(step, {item: getattr(target, item) for item in ARRAY_ITEMS})

    def _refuse_misfit(self, step: int, trees: dict, saved: dict | None = None) -> None:
        """Raise ValueError if the arrays saved at `step` are not the target `trees`' (`saved`: read if not given).

        A difference in the parameters (or variables) lists every array; one in the optimizer's state alone is one
        line naming where it first differs, for it is a good checkpoint of another optimizer."""
        saved = saved or {item: self.saved_arrays(step, item) for item in trees}
        wrong = {item: mismatches({item: saved[item]}, {item: tree}) for item, tree in trees.items()}
        if any(item != "opt_state" or line.startswith(f"opt_state/{MASTER}/") for item in wrong for line in wrong[item]):
            lines = [line for item in trees for line in wrong[item]]
            raise ValueError(f"checkpoint step {step} in {self.directory} does not fit the model:{listing(lines)}")
        if wrong.get("opt_state"):
            where = structure_difference(saved["opt_state"], trees["opt_state"], "opt_state") or wrong["opt_state"][0]
            raise ValueError(self._other_optimizer(step, f"{where}; {len(wrong['opt_state'])} arrays differ"))

    def _other_optimizer(self, step: int, where: str) -> str:
        return (f"checkpoint step {step} in {self.directory} does not fit the model's optimizer: the optimizer's "
                f"state tree differs at {where} (the parameters fit: it was saved with another optimizer or precision)")

    def _read_arrays(self, step: int, trees: dict):
        """The items of `trees` (abstract targets) that hold arrays, read from `step` onto their shardings and
        verified: (restored, the items read). Containers that differ while every array agrees (adamw's state read
        as adam's: one empty part fewer) make Orbax fail; they are named as a misfit, never as damage."""
        arrays = {item: ocp.args.PyTreeRestore(tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
                  for item, tree in trees.items() if jax.tree.leaves(tree)}
        try:
            restored = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore(), **arrays))
        except CorruptCheckpoint as error:
            if STRUCTURE_ERROR not in str(error):
                raise
            for item in arrays:
                where = structure_difference(self.saved_arrays(step, item), trees[item], item)
                if where and item == "opt_state":
                    raise ValueError(self._other_optimizer(step, where)) from None
                if where:
                    raise ValueError(f"checkpoint step {step} in {self.directory} does not fit the model: "
                                     f"{where}") from None
            raise
        self._verify(step, restored.meta, {item: restored[item] for item in arrays})
        return restored, arrays

    def restore(self, model: ModelDef, optimizer: optax.GradientTransformation, plan: Plan,
                step: int | None = None) -> tuple[TrainState, dict]:
        """The state saved at `step` (default the newest) laid out for `plan`, and its metadata.

        Each device reads only its own shards under `plan`, so the state is never
        whole on one device, whatever plan saved it. The checkpoint's natural
        layer order becomes `plan`'s (jaxpar.pipeline.layer_order) once read and verified.
        """
        state, meta = self._restore(self.resolve_step(step), abstract_state(model, optimizer, plan))
        if layer_order.reorders(plan):
            state = self._reordered(state, model, optimizer, plan, to_natural=False)
        return state, meta

    def _restore(self, step: int, target: TrainState) -> tuple[TrainState, dict]:
        """The state saved at `step` read onto the shardings of `target` (an abstract state)."""
        saved_optimizer = self.saved_arrays(step, "opt_state")
        saved_master = isinstance(saved_optimizer, dict) and MASTER in saved_optimizer
        if saved_master and not isinstance(target.opt_state, precision.MasterState):
            return self._restore_with_master(step, target, saved_optimizer)
        if isinstance(target.opt_state, precision.MasterState) and not saved_master:
            return self._restore_into_master(step, target)
        self.check_fits(target, step)
        restored, arrays = self._read_arrays(step, {item: getattr(target, item) for item in _filled(target)})
        counter = jax.device_put(jnp.asarray(restored.meta["step"], jnp.int32), target.step.sharding)
        items = {item: restored[item] if item in arrays else getattr(target, item) for item in ARRAY_ITEMS}
        return TrainState(**items, step=counter), restored.meta

    def _restore_with_master(self, step: int, target: TrainState, saved: dict) -> tuple[TrainState, dict]:
        """A checkpoint with an fp32 master (ZeRO-1's, or an older one) restored onto fp32 params held once: its
        master becomes the params (its 2-byte params, a cast of the master, are not read), its inner state the
        optimizer's."""
        scaled = isinstance(target.opt_state, precision.ScaledState)
        inner = target.opt_state.inner if scaled else target.opt_state
        legacy = {MASTER: target.params, "inner": inner, "loss_scale": target.opt_state.loss_scale if scaled else None}
        trees = {"opt_state": legacy, **({"variables": target.variables} if "variables" in _filled(target) else {})}
        self._refuse_misfit(step, trees, {**{item: self.saved_arrays(step, item) for item in trees},
                                          "opt_state": saved})
        restored, arrays = self._read_arrays(step, trees)
        opt = restored["opt_state"]
        opt_state = precision.ScaledState(opt["inner"], opt["loss_scale"]) if scaled else opt["inner"]
        counter = jax.device_put(jnp.asarray(restored.meta["step"], jnp.int32), target.step.sharding)
        variables = restored["variables"] if "variables" in arrays else target.variables
        return TrainState(opt[MASTER], opt_state, counter, variables), restored.meta

    def _restore_into_master(self, step: int, target: TrainState) -> tuple[TrainState, dict]:
        """A checkpoint of fp32 params held once restored onto ZeRO-1's master layout: the saved fp32 params
        become the master (read straight into its shards over data), the params its 2-byte cast."""
        opt = target.opt_state
        scaled = opt.loss_scale is not None
        saved_opt = precision.ScaledState(opt.inner, opt.loss_scale) if scaled else opt.inner
        trees = {"params": opt.master, "opt_state": saved_opt,
                 **({"variables": target.variables} if "variables" in _filled(target) else {})}
        self._refuse_misfit(step, trees)
        restored, arrays = self._read_arrays(step, trees)
        master = restored["params"]
        inner = restored["opt_state"] if "opt_state" in arrays else saved_opt
        inner, loss_scale = (inner.inner, inner.loss_scale) if scaled else (inner, None)
        shardings = jax.tree.map(lambda a: a.sharding, target.params)
        params = jax.jit(lambda m: jax.tree.map(lambda x, p: x.astype(p.dtype), m, target.params),
                         out_shardings=shardings)(offload.fetched(master))
        counter = jax.device_put(jnp.asarray(restored.meta["step"], jnp.int32), target.step.sharding)
        variables = restored["variables"] if "variables" in arrays else target.variables
        return TrainState(params, precision.MasterState(master, inner, loss_scale), counter, variables), restored.meta

    def read_params(self, step: int | None = None) -> dict:
        """The parameters saved at `step` as whole host numpy arrays, for export: the exact fp32 weights
        under bf16/fp16 (the master of an older checkpoint), else the parameters as held. A LoRA run's frozen
        weights have no master: they come as held."""
        step = self.resolve_step(step)
        optimizer = self.saved_arrays(step, "opt_state")
        trees = {"params": self.saved_arrays(step, "params")}
        if isinstance(optimizer, dict) and MASTER in optimizer:
            trees = {"params": _without(trees["params"], optimizer[MASTER]), "opt_state": {MASTER: optimizer[MASTER]}}
        if not any(jax.tree.leaves(tree) for tree in trees.values()):
            raise ValueError(f"checkpoint step {step} in {self.directory} is unreadable: it holds no parameters")
        reads = {item: ocp.args.PyTreeRestore(tree, partial_restore=True, restore_args=jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)) for item, tree in trees.items() if tree}
        restored = self._read(step, ocp.args.Composite(meta=ocp.args.JsonRestore(), **reads))
        self._verify(step, restored.meta, {item: restored[item] for item in reads})
        params = restored["params"] if "params" in reads else {}
        return _with(params, restored["opt_state"][MASTER]) if "opt_state" in reads else params

    def wait(self) -> None:
        """Block until every save in flight is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        _OPEN.discard(self)
        self._manager.close()

    def abandon(self) -> bool:
        """Give up the saves in flight (at exit, interrupted): their half-written step directories removed. True if
        there were some."""
        _OPEN.discard(self)
        removed = self._remove_half_written()
        for _ in range(20 if removed else 0):  # TensorStore's own threads may still be writing into it: until it stays gone
            time.sleep(0.25)
            if not self._remove_half_written():
                break
        return removed

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _without(tree, other):
    """`tree` (nested dicts) without the leaves `other` holds; None where nothing is left."""
    if not isinstance(tree, dict):
        return None if other is not None else tree
    out = {k: _without(v, other.get(k) if isinstance(other, dict) else None) for k, v in tree.items()}
    return {k: v for k, v in out.items() if v is not None} or None


def _with(tree, other):
    """`tree` (nested dicts) with `other`'s leaves added or put in place of its own."""
    if not isinstance(tree, dict) or not isinstance(other, dict):
        return other if other is not None else tree
    return {**tree, **{k: _with(tree.get(k), v) for k, v in other.items()}}

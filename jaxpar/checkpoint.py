"""Checkpoints for a training loop of one's own, kept as `jaxpar train` keeps them (a stable public name).

    from jaxpar.checkpoint import Checkpoints

    with Checkpoints("ck", model, optimizer, plan, save_every=100, keep=3) as checkpoints:
        if checkpoints.latest_step() is not None:
            state, data_state = checkpoints.restore()       # exact resume, onto this plan
        for step in range(int(state.step), steps):
            state, metrics = train_step(state, batch(step))
            checkpoints.save(step + 1, state, data_state={"position": step + 1})
            if checkpoints.reached_preemption(step + 1):    # SIGTERM: saved above, now stop
                break

One object the loop calls each step, with the face of Orbax's `CheckpointManager` (`save`, `restore`,
`latest_step`, `all_steps`, `wait_until_finished`, `reached_preemption`) over jaxpar's own checkpoints
(`jaxpar.train.checkpoint`): each array written shard by shard, asynchronously, by the devices holding it;
restored straight into the shards of any plan or mesh (another ZeRO stage, tensor or pipeline layout); a
checksum of every array checked on restore (`CorruptCheckpoint`; `restore()` falls back past a damaged step and
sets it aside, as `jaxpar train` does); SIGTERM (a scheduler's preemption notice) turning the next `save` into a
forced one and `reached_preemption` true, agreed by every process; and `data_state`, any JSON value the loop
wants back with the step (a data loader's position, grain's `iterator.get_state()` decoded). Under
`jaxpar launch`, each `save` call also tells the launcher the step completed (`jaxpar.distributed.heartbeat`),
and opening the directory tells it where the checkpoints are (its reports and restarts name the last complete one).

Close it (`with`, or `close()` in a `finally`): that waits for the saves in flight. One left open is finished when
the script dies of an uncaught exception (Ctrl-C too) and, on Python 3.11, at its end; Python >= 3.12 starts no
thread at exit, so there the save in flight is removed, said so (`jaxpar.train.checkpoint`). A checkpoint of another
optimizer is refused in one line naming where its state tree differs, never called damaged nor set aside.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import optax

from jaxpar.core.plan import Plan
from jaxpar.train.checkpoint import Checkpoints as _Directory
from jaxpar.train.checkpoint import CorruptCheckpoint
from jaxpar.train.distributed import heartbeat, is_leader
from jaxpar.train.preemption import Preemption
from jaxpar.train.state import ModelDef, TrainState

DATA_STATE = "data_state"  # the metadata key the loop's `data_state` is saved under

__all__ = ["Checkpoints", "CorruptCheckpoint"]


class Checkpoints:
    """A training loop's checkpoint directory for one model, optimizer and plan (see the module docstring).

    `model`, `optimizer`, `plan`: what `jaxpar.init_state` was given and returned (the plan the state is laid out
    for; restoring onto another plan is opening the directory with that plan). `save_every`: `save` writes the
    steps that are multiples of it (and any step it is forced to); `keep`: the newest kept (None: all);
    `read_only`: open another run's directory to restore from, never writing or deleting.
    """

    def __init__(self, directory, model: ModelDef, optimizer: optax.GradientTransformation, plan: Plan, *,
                 save_every: int = 1, keep: int | None = None, async_save: bool = True, read_only: bool = False):
        self.model, self.optimizer, self.plan = model, optimizer, plan
        self._directory = _Directory(directory, save_every=save_every, keep=keep, async_save=async_save,
                                     read_only=read_only)
        self.directory = self._directory.directory
        self._preemption = None if read_only else Preemption().__enter__()
        self._agreed: tuple[int, bool] | None = None  # the last step asked about, and the answer (asked once)

    def latest_step(self) -> int | None:
        """The newest complete step (None before the first save completes)."""
        return self._directory.latest_step()

    def all_steps(self) -> list[int]:
        """The complete steps, oldest first."""
        return self._directory.steps()

    def reached_preemption(self, step: int) -> bool:
        """True once SIGTERM came (with several processes: once all agree to stop after `step`)."""
        if self._preemption is None:
            return False
        if self._agreed is None or self._agreed[0] != step:
            self._agreed = (step, self._preemption.reached(step))
        return self._agreed[1]

    def save(self, step: int, state: TrainState, *, data_state: Any = None, force: bool = False) -> bool:
        """Start saving `state` as `step` if it is due (a multiple of `save_every`, `force`, or a preemption); True
        if started. Returns once the arrays are copied off the devices; the write finishes in the background."""
        heartbeat(step)
        try:
            json.dumps(data_state)
        except (TypeError, ValueError) as error:
            raise TypeError(f"data_state must be a JSON value (dicts, lists, str, numbers), got "
                            f"{type(data_state).__name__}: {error}") from None
        force = force or self.reached_preemption(step)
        return self._directory.save(step, state, force=force, metadata={DATA_STATE: data_state}, model=self.model,
                                    optimizer=self.optimizer, plan=self.plan)

    def restore(self, step: int | None = None) -> tuple[TrainState, Any]:
        """(state, data_state) of `step` laid out for this plan, whatever plan saved it.

        Without `step`: the newest intact step; damaged newer ones are said so on stderr and renamed
        `<step>.corrupted` (a read-only directory raises instead). CorruptCheckpoint when `step` is damaged."""
        if step is not None or self._directory.read_only:
            state, meta = self._directory.restore(self.model, self.optimizer, self.plan, step)
            return state, meta.get(DATA_STATE)
        damaged = []
        for candidate in reversed(self.all_steps()):
            try:
                state, meta = self._directory.restore(self.model, self.optimizer, self.plan, candidate)
            except CorruptCheckpoint as error:
                damaged.append(error)
                continue
            for error in damaged:
                kept = self._directory.set_aside(error.step)
                if is_leader():
                    print(f"warning: {error}\n  kept it as {kept}; restored step {candidate}, the newest intact one",
                          file=sys.stderr, flush=True)
            return state, meta.get(DATA_STATE)
        if damaged:
            raise damaged[0]
        raise ValueError(f"checkpoint directory {str(self.directory)!r} holds no complete checkpoint")

    def metadata(self, step: int | None = None) -> dict:
        """The JSON saved with `step` (default the newest): its step, `data_state` and the array checksums."""
        return self._directory.metadata(step)

    def wait_until_finished(self) -> None:
        """Block until every save in flight is on disk."""
        self._directory.wait()

    def close(self) -> None:
        """Finish the saves in flight, close the directory, give SIGTERM back its previous handler."""
        try:
            self._directory.wait()
            self._directory.close()
        finally:
            if self._preemption is not None:
                self._preemption.__exit__(None, None, None)
                self._preemption = None

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""What a rank tells `jaxpar launch` (train/launcher.py): its steps, its sign of life, its checkpoints, its exit.

Through two files the launcher names in HEARTBEAT_ENV: `rankN.beat` holds the last step completed (and, once
`jaxpar.checkpoint.Checkpoints` opened one, the checkpoint directory, so that reports and restarts of a script of
one's own name its last complete checkpoint); `rankN.alive` is touched twice a second by a thread, which goes on
while the main thread waits in a collective and stops when the process hangs, and holds what the main thread is
doing: `checkpoint` while it is in checkpoint code (a save is neither a step nor a silence).

A rank that ends with an error after `jax.distributed.initialize()` (`sys.exit(3)`, an uncaught exception, a
configuration error found on one rank) would stay in jax's distributed shutdown at interpreter exit, a barrier
of every process that its peers, waiting in a collective on it, never reach: alive, and its error unseen.
`watch_exit` ends such a process at once with its own code, before that barrier and before non-daemon threads
are joined, so the launcher (or srun --kill-on-bad-exit) sees the rank's code within a second.
"""

from __future__ import annotations

import dis
import json
import os
import sys
import threading
import time
from pathlib import Path

HEARTBEAT_ENV = "JAXPAR_HEARTBEAT_FILE"  # the rank writes its step there after every step; `.alive` beside it: life
CHECKPOINT = "checkpoint"  # what the sign of life says while the main thread reads or writes a checkpoint
CHECKPOINT_MODULES = ("jaxpar.train.checkpoint", "orbax.")  # a frame of these on the main thread's stack: checkpoint

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES")

_told: dict = {"step": None}  # what this rank has told the launcher: its last step, its checkpoint directory
_seen: dict = {}  # how this process is ending: the code of its last sys.exit, an uncaught exception's code


def _recording_exit(code=None, *, _exit=sys.exit):
    """sys.exit, which also keeps its code for watch_exit."""
    _seen["exit"] = code
    _exit(code)


if any(name in os.environ for name in CLUSTER_ENV):  # a rank of a job: watched from `import jaxpar` on, so that
    sys.exit = _recording_exit  # `sys.exit(main())`, whose sys.exit is looked up before main() joins, is seen


def alive_file(beat) -> Path:
    """Where a rank's sign of life goes, beside its heartbeat file."""
    return Path(beat).with_suffix(".alive")


def _write_beat() -> None:
    if HEARTBEAT_ENV in os.environ:
        told = _told if len(_told) > 1 else _told["step"]  # a bare step unless there is more to tell
        Path(os.environ[HEARTBEAT_ENV]).write_text(json.dumps(told))


def heartbeat(step: int) -> None:
    """Under `jaxpar launch`, tell the launcher that this rank completed `step`: its death reports' "last step it
    completed" and the clock of `--heartbeat-s` (a no-op elsewhere)."""
    _told["step"] = step
    _write_beat()


def tell_checkpoints(directory) -> None:
    """Under `jaxpar launch`, tell the launcher where this rank's checkpoints go: its reports and restarts name the
    last complete one (jaxpar.checkpoint.Checkpoints calls it; a no-op elsewhere)."""
    _told["checkpoints"] = str(Path(directory).absolute())
    _write_beat()


def doing(frame) -> str:
    """What a thread whose current frame is `frame` is doing, as the sign of life says it: CHECKPOINT or ''."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(CHECKPOINT_MODULES):
            return CHECKPOINT
        frame = frame.f_back
    return ""


def show_life(every_s: float = 0.5) -> None:
    """Under `jaxpar launch`, write this rank's sign-of-life file from a thread (its mtime: alive; its text: what the
    calling thread is doing), which runs on while that thread waits in a collective but not when the process hangs:
    the launcher names the hung rank, not its waiting peers, and does not time a save as a step."""
    if HEARTBEAT_ENV not in os.environ:
        return
    path, watched = alive_file(os.environ[HEARTBEAT_ENV]), threading.get_ident()

    def beat() -> None:
        while True:
            path.write_text(doing(sys._current_frames().get(watched)))
            time.sleep(every_s)

    threading.Thread(target=beat, daemon=True, name="jaxpar-alive").start()


def watch_exit() -> None:
    """From now on, a non-zero exit of this process (an uncaught exception: 1; `sys.exit(n)`: n) flushes its output
    and ends it at once with that code, skipping jax's distributed shutdown (see the module docstring).

    The code is known from `sys.excepthook` and from `sys.exit`, watched here (from `import jaxpar` on in a job);
    whether that `sys.exit` ended the program, rather than being caught, from where the outermost frame stopped:
    not at a return. A bare `raise SystemExit(n)` is not seen and exits as Python does."""
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    outermost, previous_hook = frame, sys.excepthook

    def excepthook(kind, value, traceback):
        _seen["uncaught"] = 130 if issubclass(kind, KeyboardInterrupt) else 1
        previous_hook(kind, value, traceback)

    def at_shutdown() -> None:  # threading's, before non-daemon threads are joined and atexit's handlers run
        code = _seen.get("uncaught") or (_exit_code(_seen["exit"]) if "exit" in _seen and _raised(outermost) else 0)
        if code:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (AttributeError, OSError, ValueError):
                    pass
            os._exit(code)

    if sys.exit is not _recording_exit:
        sys.exit = _recording_exit
    sys.excepthook = excepthook
    threading._register_atexit(at_shutdown)


def _raised(frame) -> bool:
    """True when `frame`, finished, ended by an exception (it stopped on another instruction than a return)."""
    return not dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("RETURN")


def _exit_code(code) -> int:
    """The status Python exits with for `sys.exit(code)` (a message, which Python has printed: 1)."""
    return int(code or 0) if code is None or isinstance(code, int) else 1

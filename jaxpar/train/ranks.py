"""The processes of a `jaxpar launch` job: started, their output kept, what they tell read (train/rank_report.py).

Each rank runs in a session of its own, so a terminal's Ctrl-C reaches the launcher alone, and it carries Linux's
parent-death signal, so even a SIGKILLed launcher leaves no orphan. The signal is set by a small exec wrapper,
not a `preexec_fn`: Python runs its fork hooks around a `preexec_fn`, and jax's warns that forking a multithreaded
process may deadlock; without one, subprocess forks and execs in C.

With restarts left, each start also starts the next one's ranks ahead (`Spares`): a `jaxpar` rank is mostly its
interpreter and imports before it does anything of its own (seconds on a loaded host), so a spare does them while
the job runs and then waits for the launcher's word (its environment, with the new coordinator) on its stdin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxpar.train.rank_report import CHECKPOINT, HEARTBEAT_ENV, alive_file

RANK_OUTPUT_ENV = "JAXPAR_RANK_OUTPUT"  # set for ranks whose output goes to a file: they print like rank 0
SPARE_ENV = "JAXPAR_SPARE"  # set for a rank started ahead of a restart: it waits for its environment on stdin
SPARE_ANY = ("JAX_COORDINATOR_ADDRESS",)  # what may differ between a spare's environment and its start's
ERROR_LINES = 8  # the last lines of a failing rank's stderr that the launcher shows

# PR_SET_PDEATHSIG (1): the kernel SIGKILLs this process when the launcher dies; kept across exec.
_DIE_WITH_LAUNCHER = """import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + signal.SIGKILL)  # the launcher died before the signal was set
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as error:
    print(f"jaxpar launch: cannot run {sys.argv[2]!r}: {error}", file=sys.stderr, flush=True)
    os._exit(127)
"""


def dying_with_launcher(command: list[str]) -> list[str]:
    """`command` run so that it dies with the launcher (Linux; elsewhere `command` itself)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_LAUNCHER, str(os.getpid()), *command]


@dataclasses.dataclass
class Rank:
    """One started process of the job: where its output goes, what its heartbeat said, when it ended."""

    rank: int
    process: subprocess.Popen
    logs: tuple[Path, ...] = ()  # its kept rankN.out and rankN.err (none: rank 0 on the console, or temporary)
    copiers: tuple[threading.Thread, ...] = ()  # rank 0's output to the console and its logs
    ended_at: float | None = None  # when the process ended, by a thread waiting on it: deaths are told apart by order
    heartbeat: Path | None = None  # holds the last step this rank completed; its mtime is when
    last_step: int | None = None
    slowest_step_s: float = 0.0  # the longest time between two of its steps (the first, and a save's, not counted)
    err: Path | None = None  # where its stderr goes (a kept or a temporary file): the report shows its end
    err_from: int = 0  # where this start's stderr begins in that file (logs are appended across restarts)
    checkpoints: str | None = None  # the checkpoint directory the rank told (jaxpar.checkpoint.Checkpoints)
    stepped_at: float | None = None  # the mtime of its last step's heartbeat
    checkpointing_at: float = 0.0  # the last time its sign of life said it was in checkpoint code

    def __post_init__(self):
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.process.wait()
        self.ended_at = time.monotonic()

    def alive(self) -> bool:
        return self.ended_at is None

    def step(self) -> int | None:
        """The last step this rank completed, from its heartbeat file (None before its first)."""
        self.observe()
        return self.last_step

    def observe(self) -> None:
        """Read what the rank told: its last step, the slowest step so far (for the default heartbeat; a step
        whose time held a save not counted), its checkpoint directory, whether it is in checkpoint code."""
        try:
            life = alive_file(self.heartbeat)
            if life.read_text() == CHECKPOINT:
                self.checkpointing_at = max(self.checkpointing_at, life.stat().st_mtime)
        except (TypeError, FileNotFoundError):
            pass
        try:
            stat, told = self.heartbeat.stat(), json.loads(self.heartbeat.read_text())
        except (AttributeError, FileNotFoundError, ValueError):  # no file yet, or caught mid-rewrite
            return
        told = told if isinstance(told, dict) else {"step": told}
        self.checkpoints = told.get("checkpoints") or self.checkpoints
        step = told.get("step")
        if step is None or step == self.last_step:
            return
        if self.last_step is not None and not self.stepped_at < self.checkpointing_at < stat.st_mtime:
            self.slowest_step_s = max(self.slowest_step_s, stat.st_mtime - self.stepped_at)
        self.last_step, self.stepped_at = step, stat.st_mtime

    def silent_for(self) -> float | None:
        """Seconds since this rank's last step or checkpoint work, or None before its first step (start-up and
        compilation are not timed)."""
        if self.stepped_at is None:
            return None
        return time.time() - max(self.stepped_at, self.checkpointing_at)

    def lifeless_for(self) -> float | None:
        """Seconds since this rank last showed a sign of life, or None if it never did (no thread: not judged)."""
        return None if self.heartbeat is None else _age(alive_file(self.heartbeat))

    def error_lines(self) -> list[str]:
        """The last non-blank lines this start of the rank wrote to its stderr (none when it went to the console)."""
        try:
            with self.err.open("rb") as file:
                file.seek(self.err_from)
                text = file.read().decode(errors="replace")
        except (AttributeError, OSError):
            return []
        return [line for line in text.splitlines() if line.strip()][-ERROR_LINES:]


def _age(path: Path | None) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except (AttributeError, FileNotFoundError):
        return None


def _tee(source, console, log) -> None:
    for line in iter(source.readline, b""):
        console.buffer.write(line)
        console.flush()
        log.write(line)
        log.flush()
    source.close()
    log.close()


def start(commands: list[list[str]], envs: list[dict], log_dir: Path | None, beat_dir: Path | None = None,
          spares: "Spares | None" = None) -> list[Rank]:
    """Start one process per command. Rank 0 prints to the console (and its logs); the others to their logs only.

    With `beat_dir`, each rank is told (HEARTBEAT_ENV) to write its step to `beat_dir/rankN.beat` after every
    step; without a `log_dir`, the output of ranks other than 0 goes to `beat_dir` (temporary): a failing rank's
    last error lines are shown whether its logs are kept or not. With `spares`, a rank started ahead for this
    start is used where it fits, and the next start's are started.
    """
    for directory in (log_dir, beat_dir):
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
    ranks, specs = [], []
    for rank, (command, env) in enumerate(zip(commands, envs, strict=True)):
        beat = None if beat_dir is None else Path(beat_dir) / f"rank{rank}.beat"
        if beat is not None:
            for stale in (beat, alive_file(beat)):  # a restart's clock starts at its own first step
                stale.unlink(missing_ok=True)
            env = {**env, HEARTBEAT_ENV: str(beat)}
        out_dir = log_dir if log_dir is not None else (beat_dir if rank else None)
        spec = (rank, dying_with_launcher(command), env, out_dir, beat, log_dir is not None)
        ranks.append((spares and spares.take(spec)) or _start_rank(*spec))
        specs.append(spec)
    if spares is not None:
        spares.started(specs)
    return ranks


class Spares:
    """The ranks of the job's next start, started ahead while `restarts` are left (see the module docstring)."""

    def __init__(self, restarts: int):
        self.left = restarts
        self.ready: list[tuple[tuple, Rank]] = []

    def take(self, spec: tuple) -> Rank | None:
        """The live spare started for `spec` (a rank's command, environment and output), told to go; else None."""
        for index, (ready_spec, spare) in enumerate(self.ready):
            if _same_start(ready_spec, spec) and spare.alive():
                del self.ready[index]
                try:
                    spare.process.stdin.write((json.dumps(spec[2]) + "\n").encode())
                    spare.process.stdin.close()
                except OSError:
                    return None
                spare.err_from = spare.err.stat().st_size if spare.err is not None else 0  # this start's own lines
                return spare
        return None

    def started(self, specs: list[tuple]) -> None:
        """A start took what it could: let the other spares go, and start the next start's while restarts are left."""
        self.close()
        if self.left > 0:
            self.left -= 1
            self.ready = [(spec, _start_rank(*spec, spare=True)) for spec in specs]

    def close(self) -> None:
        """End the spares not taken (their stdin closed: they exit; SIGKILL whatever does not at once)."""
        for _, spare in self.ready:
            try:
                spare.process.stdin.close()
            except OSError:
                pass
            spare.process.kill()
            spare.process.wait()
        self.ready = []


def _same_start(a: tuple, b: tuple) -> bool:
    """Whether a spare started for `a` can be the rank `b`: all alike but the environment's SPARE_ANY."""
    def env(spec):
        return {k: v for k, v in spec[2].items() if k not in SPARE_ANY}

    return a[:2] == b[:2] and a[3:] == b[3:] and env(a) == env(b)


def wait_if_spare() -> None:
    """In a rank started as a spare (SPARE_ENV), wait for the launcher's word: the environment to run in, or the
    end of stdin (not needed: exit 0). Elsewhere returns at once."""
    if SPARE_ENV not in os.environ:
        return
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    del os.environ[SPARE_ENV]
    os.environ.update(json.loads(line))


def _start_rank(rank: int, command: list[str], env: dict, out_dir: Path | None, beat: Path | None,
                kept: bool, spare: bool = False) -> Rank:
    """Start one rank; a `spare` waits for its word on its stdin (Spares.take) before it runs."""
    more = {"stdin": subprocess.PIPE, "env": {**env, SPARE_ENV: "1"}} if spare else {"env": env}
    if out_dir is None:  # rank 0 without a log directory: on the console only
        return Rank(rank, subprocess.Popen(command, start_new_session=True, **more), heartbeat=beat)
    logs = (Path(out_dir) / f"rank{rank}.out", Path(out_dir) / f"rank{rank}.err")
    files = [path.open("ab") for path in logs]
    where = {"logs": logs if kept else (), "heartbeat": beat, "err": logs[1], "err_from": files[1].tell()}
    if rank:
        more["env"] = {**more["env"], RANK_OUTPUT_ENV: "1"}
        process = subprocess.Popen(command, stdout=files[0], stderr=files[1], start_new_session=True, **more)
        for file in files:
            file.close()  # the child holds its own copies
        return Rank(rank, process, **where)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               **more)
    copiers = tuple(threading.Thread(target=_tee, args=streams, daemon=True) for streams in
                    ((process.stdout, sys.stdout, files[0]), (process.stderr, sys.stderr, files[1])))
    for copier in copiers:
        copier.start()
    return Rank(rank, process, copiers=copiers, **where)

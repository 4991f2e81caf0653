"""The supervisor of `jaxpar launch`: starts the ranks, keeps their output, contains a death, passes signals on.

A job of N cooperating processes is only as alive as its weakest rank: when
one dies the others block in a collective forever. So on a death the launcher
ends the rest at once (SIGTERM, SIGKILL 0.25 s later: a rank whose peer is
dead cannot save, and a restart waits for them), checks that none remains, and prints one block saying who
died, how, the last step it completed, the last checkpoint and the command that
resumes. SIGTERM or SIGINT to the launcher (a scheduler's preemption notice, a
Ctrl-C) is forwarded to every rank as SIGTERM, on which `jaxpar train` saves and
stops within the grace period; a second Ctrl-C kills everything at once.
With `max_restarts`, a death starts the job again (it resumes from its checkpoints).

Every rank writes its step to its heartbeat file after each step (run/training.py)
and touches a sign of life twice a second from a thread (rank_report.py), which a
rank waiting in a collective keeps doing and a hung (stopped, wedged) rank does
not. When no step comes for `heartbeat_s` (default: 10 times the slowest step
seen, at least a minute; time in checkpoint code is neither a step nor a silence)
the job is ended, and the rank named is the one without a sign of life: the hung
one, not the peers waiting on it. Before its first step (start-up, compilation) a
rank is judged by its sign of life alone, for as long. A rank that ends with an
error ends at once with its own code, also after jax.distributed.initialize()
(rank_report.watch_exit), and the report shows its last error lines.

Exit codes: 0 when every rank exited 0 (also after a forwarded SIGTERM whose
save completed); 2 for a configuration error found before any step; otherwise
the first failing rank's code, or 128 + the signal number when a signal killed
it (the shell's convention: 137 for SIGKILL).
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from jaxpar.core.timeline import mark
from jaxpar.train.rank_report import HEARTBEAT_ENV, alive_file  # noqa: F401 (the launcher's names for them)
from jaxpar.train.ranks import RANK_OUTPUT_ENV, Rank, Spares, start  # noqa: F401

CONFIGURATION_ERROR = 2  # `jaxpar` exits 2 on a bad command line or configuration (cli.py), found before training
DEATH_GRACE_S = 0.25  # survivors of a death get this long after SIGTERM before SIGKILL: waiting on a dead peer they
# cannot save, and a restart waits on them
LIFE_S = 3.0  # a rank whose sign of life (touched every 0.5 s) is older than this is hung, not waiting
MIN_HEARTBEAT_S, SLOWEST_STEPS = 60.0, 10  # the default heartbeat: 10x the slowest step seen, at least a minute


def checkpoint_dir_of(argv: list[str]) -> str | None:
    """The `--checkpoint-dir` of a `jaxpar train ...` command line, if it gives one."""
    for index, arg in enumerate(argv):
        if arg == "--checkpoint-dir" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--checkpoint-dir="):
            return arg.split("=", 1)[1]
    return None


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name` in a command line (`--name v` or `--name=v`), the last one given; None when absent."""
    value = None
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _with_flag(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with `name` set to `value` (every earlier occurrence dropped)."""
    out, skip = [], False
    for index, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg == name and index + 1 < len(argv):
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return [*out, name, value]


def shrunk(argv: list[str], processes: int, left: int) -> tuple[list[str], str]:
    """The `jaxpar train` command line for `left` of `processes` processes: the same layout with its `data` (or
    `replica`) axis smaller by processes/left and `--grad-accum` larger by as much, so the global batch and the loss
    curve carry on. ValueError saying why when the layout cannot shrink so (another axis would have to change)."""
    if processes % left:
        raise ValueError(f"{processes} processes do not shrink evenly to {left}")
    factor = processes // left
    mesh = _flag(argv, "--mesh")
    if mesh is None or "=" not in mesh or mesh.endswith(".toml"):  # a preset, a file, --config or the default mesh
        raise ValueError("the layout is not on the command line: give --mesh with axis sizes (data=8,...) to shrink it")
    if _flag(argv, "--config") is not None and _flag(argv, "--grad-accum") is None:
        raise ValueError("--config may set grad_accum: give --grad-accum on the command line to shrink the job")
    sizes = dict(item.split("=") for item in mesh.split(","))
    axis = next((a for a in ("data", "replica") if a in sizes and (sizes[a] == "-1" or int(sizes[a]) % factor == 0)),
                None)
    if axis is None or any(v == "-1" for a, v in sizes.items() if a != axis):
        raise ValueError(f"mesh {mesh}: neither data nor replica divides by {factor} (tensor, pipe, ... cannot shrink)")
    new_sizes = {**sizes, axis: sizes[axis] if sizes[axis] == "-1" else str(int(sizes[axis]) // factor)}
    accum = int(_flag(argv, "--grad-accum") or 1)
    new_mesh = ",".join(f"{a}={v}" for a, v in new_sizes.items())
    argv = _with_flag(_with_flag(argv, "--grad-accum", str(accum * factor)), "--mesh", new_mesh)
    return argv, (f"processes {processes} -> {left}, mesh {mesh} -> {new_mesh}, "
                  f"grad-accum {accum} -> {accum * factor}")


def shrink_to(argv: list[str], processes: int, left: int, minimum: int) -> tuple[int, list[str], str]:
    """The largest count from `left` down to `minimum` that the layout of `processes` shrinks to (`shrunk`), with its
    command line and what changed: one rule for the launcher's elastic restart and the Slurm recipe's smaller
    allocation. ValueError saying why when none does."""
    why = f"{left} processes left, fewer than --min-processes {minimum}"
    for n in range(left, minimum - 1, -1):
        try:
            return (n, *shrunk(argv, processes, n))
        except ValueError as error:
            why = str(error)
    raise ValueError(why)


def describe_exit(rank: int, code: int) -> str:
    """One line naming the rank and how it ended, so a user sees which process took the job down."""
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _read_checkpoints_soon() -> None:
    """Import what last_complete_checkpoint reads with (orbax: about 1 s), so that a death's report does not wait."""
    import jaxpar.train.checkpoint  # noqa: F401


def told_checkpoints(ranks: list[Rank]) -> str | None:
    """The checkpoint directory a rank told through its heartbeat (jaxpar.checkpoint.Checkpoints), if any did."""
    for rank in ranks:
        rank.observe()
    return next((r.checkpoints for r in ranks if r.checkpoints), None)


def last_complete_checkpoint(directory: str | None) -> int | None:
    """The newest complete step in `directory`, by the checkpoint module's own reading (None when there is none)."""
    if directory is None or not Path(directory).is_dir():
        return None
    from jaxpar.train.checkpoint import Checkpoints

    try:
        with Checkpoints(directory, read_only=True) as checkpoints:
            return checkpoints.latest_step()
    except ValueError:
        return None


class _Signals:
    """The launcher's SIGTERM/SIGINT: the first asks for a stop (forwarded), a second SIGINT for a kill now."""

    def __init__(self):
        self.stop_requested = None
        self.kill_now = False
        self._previous = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._notice)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _notice(self, signum, frame) -> None:
        if self.stop_requested is not None and signum == signal.SIGINT:
            self.kill_now = True
        self.stop_requested = self.stop_requested or signal.Signals(signum).name


def _signal_all(ranks: list[Rank], signum: int) -> None:
    for rank in ranks:
        if rank.alive():
            try:
                rank.process.send_signal(signum)
            except ProcessLookupError:
                pass


def _end(ranks: list[Rank], grace_s: float, signals: _Signals) -> tuple[list[int], str]:
    """SIGTERM every live rank, SIGKILL what remains after `grace_s` (or at a second Ctrl-C).

    Returns the ranks SIGKILLed and when, for the report."""
    _signal_all(ranks, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(rank.alive() for rank in ranks) and time.monotonic() < deadline and not signals.kill_now:
        time.sleep(0.05)
    killed = [rank.rank for rank in ranks if rank.alive()]
    _signal_all(ranks, signal.SIGKILL)
    _reap(ranks)
    return killed, "at the second Ctrl-C" if signals.kill_now else f"{grace_s:g} s after SIGTERM"


def _reap(ranks: list[Rank]) -> None:
    """Wait for every rank, and for rank 0's output to reach its logs (the report reads them)."""
    for rank in ranks:
        rank.process.wait()
        for copier in rank.copiers:
            copier.join(timeout=5)


def _report(ranks: list[Rank], dead: Rank, killed: tuple[list[int], str], checkpoint_dir: str | None,
            resume: list[str], reason: str | None = None) -> str:
    step = dead.step()
    logged = "unknown (no heartbeat)" if dead.heartbeat is None else ("none" if step is None else str(step))
    checkpoint = last_complete_checkpoint(checkpoint_dir)
    where = (f"step {checkpoint} in {checkpoint_dir}" if checkpoint is not None
             else f"none in {checkpoint_dir}" if checkpoint_dir else "none (no --checkpoint-dir: the run cannot resume)")
    ended = ", ".join(describe_exit(r.rank, r.process.returncode) for r in ranks if r is not dead) or "no other ranks"
    lines = [
        f"jaxpar launch: {reason or describe_exit(dead.rank, dead.process.returncode)} (pid {dead.process.pid})",
        f"  last step it completed:   {logged}" + (f"  ({dead.logs[0].parent})" if dead.logs else ""),
        f"  last complete checkpoint: {where}",
        f"  the other ranks:          {ended}" + (f"; SIGKILLed {killed[1]}: {killed[0]}" if killed[0] else ""),
        f"  no process of the job remains",
    ]
    code = dead.process.returncode  # the end it came to by itself, not a kill; rank 0's stderr is on the console
    own_end = code > 0 or (code < 0 and -code not in (signal.SIGKILL, signal.SIGTERM))
    errors = dead.error_lines() if reason is None and own_end and dead.rank else []
    if errors:
        lines += [f"  its stderr ended with:    ({dead.err})", *(f"    {line}" for line in errors)]
    return "\n".join([*lines, f"  resume with:              {shlex.join(resume)}"])


def _exit_code(code: int) -> int:
    return code if code > 0 else 128 - code


def supervise(ranks: list[Rank], *, grace_s: float = 30.0, checkpoint_dir: str | None = None,
              resume: list[str] = (), heartbeat_s: float | None = None) -> int:
    """Wait for the ranks; contain and report a death; forward the launcher's SIGTERM/SIGINT. Returns the exit code.

    `heartbeat_s`: how long without a step ends the job (None: the default that follows the slowest step; 0: never).
    """
    with _Signals() as signals:
        return _supervise(ranks, grace_s, checkpoint_dir, list(resume), signals, heartbeat_s)[0]


def run(start_ranks: Callable[[], list[Rank]], *, max_restarts: int = 0, grace_s: float = 30.0,
        checkpoint_dir: str | None = None, resume: list[str] = (), heartbeat_s: float | None = None,
        events: Path | None = None, lost: Callable[[int], bool] = lambda rank: False,
        shrink: Callable[[int], str] | None = None) -> int:
    """Start the job and supervise it; after a death start it again, up to `max_restarts` times.

    A restart is the same command: `jaxpar train` resumes from the newest complete
    checkpoint. A stop the launcher was asked for (SIGTERM/SIGINT) is never restarted.
    `events`: a JSON lines file that gets one line per start, death, restart, shrink and stop (`jaxpar launch --status`).
    A dead rank that cannot come back (`lost`) is restarted without: `shrink(processes left)` makes the next start
    smaller and says how, or raises ValueError saying why it cannot.
    """
    record = _Events(events)
    threading.Thread(target=_read_checkpoints_soon, daemon=True).start()  # while the ranks start, not after a death
    with _Signals() as signals:
        for attempt in range(max_restarts + 1):
            ranks = start_ranks()
            mark("launcher: ranks started")
            record("start", attempt=attempt, pids=[r.process.pid for r in ranks])
            code, restartable, outcome = _supervise(ranks, grace_s, checkpoint_dir, list(resume), signals, heartbeat_s)
            checkpoint_dir = checkpoint_dir or told_checkpoints(ranks)  # a script's own, through its heartbeat
            if restartable:
                record("death", **outcome)
            if not restartable or signals.stop_requested or attempt == max_restarts:
                record("stop", exit_code=code, **({} if restartable else outcome))
                return code
            mark("launcher: report printed")
            step = last_complete_checkpoint(checkpoint_dir)
            mark("launcher: checkpoint read")
            where = "the start (no complete checkpoint)" if step is None else f"step {step}"
            if lost(outcome["rank"]):
                try:
                    change = shrink(len(ranks) - 1) if shrink is not None else None
                except ValueError as error:
                    change, why = None, str(error)
                else:
                    why = "no --min-processes"
                if change is None:
                    print(f"jaxpar launch: rank {outcome['rank']} cannot come back and the job cannot shrink: {why}",
                          file=sys.stderr, flush=True)
                    record("stop", exit_code=code, cause=f"rank {outcome['rank']} lost; cannot shrink: {why}")
                    return code
                print(f"jaxpar launch: rank {outcome['rank']} cannot come back; shrinking: {change}",
                      file=sys.stderr, flush=True)
                record("shrink", lost_rank=outcome["rank"], change=change)
            print(f"jaxpar launch: restart {attempt + 1} of {max_restarts}, from {where}", file=sys.stderr, flush=True)
            record("restart", attempt=attempt + 1, from_step=step)


class _Events:
    """The launcher's events.jsonl: one line per event with its time, appended (and flushed) as it happens."""

    def __init__(self, path: Path | None):
        self.path = path

    def __call__(self, event: str, **fields) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps({"time": round(time.time(), 3), "event": event, **fields}) + "\n")


def status(log_dir: str | Path) -> str:
    """What happened to the launches that logged to `log_dir`: a line per event of its events.jsonl."""
    path = Path(log_dir) / "events.jsonl"
    if not path.is_file():
        raise ValueError(f"no {path}: `jaxpar launch` writes it in its --log-dir (default <checkpoint-dir>/logs)")
    lines = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.pop("time")))
        lines.append(f"{when}  {event.pop('event'):<8} " + "  ".join(f"{k} {v}" for k, v in event.items()))
    return "\n".join(lines)


def default_heartbeat_s(ranks: list[Rank]) -> float:
    """10x the slowest step seen (a save or an evaluation included), at least a minute: a hang ends by default."""
    return max(MIN_HEARTBEAT_S, SLOWEST_STEPS * max(r.slowest_step_s for r in ranks))


def _hung(ranks: list[Rank], heartbeat_s: float | None) -> tuple[Rank, str] | None:
    """When a live rank has made no step for the heartbeat, or shown no sign of life for as long: the rank to
    blame, and why.

    Ranks in one job step together, so a hung rank silences its waiting peers too: the one named is the rank
    without a sign of life (hung), else the one furthest behind. Before a rank's first step (start-up,
    compilation, which are not timed) only its sign of life is judged."""
    for rank in ranks:
        rank.observe()
    limit = default_heartbeat_s(ranks) if heartbeat_s is None else heartbeat_s
    lifeless = max((r for r in ranks if r.alive()), key=lambda r: r.lifeless_for() or 0, default=None)
    if limit and lifeless is not None and (lifeless.lifeless_for() or 0) > limit and lifeless.step() is None:
        return lifeless, (f"rank {lifeless.rank} hung before its first step: no sign of life for "
                          f"{lifeless.lifeless_for():.0f} s (heartbeat {limit:g} s)")
    if not limit or not any(r.alive() and (r.silent_for() or 0) > limit for r in ranks):
        return None
    live = [r for r in ranks if r.alive() and r.step() is not None]
    lifeless = max(live, key=lambda r: r.lifeless_for() or 0)
    if (lifeless.lifeless_for() or 0) > LIFE_S:
        return lifeless, (f"rank {lifeless.rank} hung: no step for {lifeless.silent_for():.0f} s and no sign of life "
                          f"for {lifeless.lifeless_for():.0f} s; the others waited on it (heartbeat {limit:g} s)")
    behind = min(live, key=lambda r: r.step())
    return behind, f"rank {behind.rank}: no step for {limit:g} s (heartbeat)"


def _cause_of(dead: Rank, ranks: list[Rank]) -> tuple[Rank, str | None]:
    """The rank to blame for a death: a live peer without a sign of life when there is one (jax's coordination
    service aborts the ranks whose peer went silent, so the first to die can be the consequence), else the dead."""
    hung = [r for r in ranks if r.alive() and (r.lifeless_for() or 0) > LIFE_S]
    if not hung:
        return dead, None
    return hung[0], (f"rank {hung[0].rank} hung (no sign of life for {hung[0].lifeless_for():.0f} s); "
                     f"{describe_exit(dead.rank, dead.process.returncode)} as a consequence")


def _configuration_error(ranks: list[Rank], failed: Rank) -> tuple[int, bool, dict]:
    """A rank exited 2 before its first step: the command's own error (a mesh too large, a bad flag), which every
    rank finds alike. Not a death: the error once, no report, no resume command, no restart."""
    deadline = time.monotonic() + 2
    while any(r.alive() for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)  # the others stop on the same error
    _signal_all(ranks, signal.SIGKILL)
    _reap(ranks)
    if ranks[0].process.returncode != CONFIGURATION_ERROR:  # rank 0 did not print it: show the failing rank's
        lines = failed.error_lines()
        own = [line for line in lines if line.startswith("error: ")]  # jaxpar's one line, when it is jaxpar
        if own:
            print(own[-1], file=sys.stderr, flush=True)
        else:
            print("\n".join([f"error: rank {failed.rank} exited with code 2 before its first step" +
                             (f"; its stderr ended with ({failed.err}):" if lines else " (no error output)"),
                             *(f"  {line}" for line in lines)]), file=sys.stderr, flush=True)
    return CONFIGURATION_ERROR, False, {"cause": "configuration error (exit 2 before any step)"}


def _supervise(ranks: list[Rank], grace_s: float, checkpoint_dir: str | None, resume: list[str],
               signals: _Signals, heartbeat_s: float | None = None) -> tuple[int, bool, dict]:
    """One start of the job, from its ranks' start to the last one's end (see the module docstring).

    Returns the exit code, whether a restart could help (a death: yes; a configuration error, a finish, a requested
    stop: no) and how it ended, for the events file."""
    try:
        while True:
            checkpoint_dir = checkpoint_dir or told_checkpoints(ranks)  # one's own script tells it once it opens it
            dead = min((r for r in ranks if not r.alive() and r.process.returncode), key=lambda r: r.ended_at,
                       default=None)  # the first to die: its peers may fail after it (a lost collective)
            if dead is not None and dead.process.returncode == CONFIGURATION_ERROR and dead.step() is None:
                return _configuration_error(ranks, dead)
            hung = None if dead is not None else _hung(ranks, heartbeat_s)
            if dead is not None or hung is not None:
                mark("launcher: death noticed")
                culprit, reason = _cause_of(dead, ranks) if dead is not None else hung
                killed = _end(ranks, DEATH_GRACE_S, signals)  # a death is certain: no save can complete, end them now
                mark("launcher: others ended")
                print(_report(ranks, culprit, killed, checkpoint_dir, resume, reason), file=sys.stderr, flush=True)
                return _exit_code(culprit.process.returncode), True, {
                    "rank": culprit.rank, "cause": reason or describe_exit(culprit.rank, culprit.process.returncode),
                    "last_step": culprit.step(), "checkpoint": last_complete_checkpoint(checkpoint_dir)}
            if not any(r.alive() for r in ranks):
                if signals.stop_requested:
                    print(f"jaxpar launch: {signals.stop_requested} forwarded; every rank saved and exited 0",
                          file=sys.stderr, flush=True)
                return 0, False, {"cause": f"{signals.stop_requested}: saved" if signals.stop_requested else "finished"}
            if signals.stop_requested:
                print(f"jaxpar launch: {signals.stop_requested}: asked every rank to save and stop "
                      f"(up to {grace_s:g} s; Ctrl-C again to kill now)", file=sys.stderr, flush=True)
                killed = _end(ranks, grace_s, signals)
                if killed[0] or any(r.process.returncode for r in ranks):
                    dead = next((r for r in ranks if r.rank in killed[0] or r.process.returncode), ranks[0])
                    print(_report(ranks, dead, killed, checkpoint_dir, resume), file=sys.stderr, flush=True)
                    return _exit_code(dead.process.returncode), False, {
                        "cause": f"{signals.stop_requested}: " + describe_exit(dead.rank, dead.process.returncode)}
                continue
            time.sleep(0.1)
    finally:
        _signal_all(ranks, signal.SIGKILL)
        _reap(ranks)

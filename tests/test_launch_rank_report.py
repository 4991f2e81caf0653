"""What a rank tells `jaxpar launch`, and what the launcher makes of it (train/rank_report.py, train/ranks.py).

A rank's own exit code at once after `initialize()`; a save neither a step nor a silence; a failing rank's last
error lines; no fork of a multithreaded launcher; JAX_COORDINATOR_PORT; a rank hung before its first step. The
children are plain Python (the rank side loaded by its path, without jax), so each test takes about a second.
"""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from jaxpar.train import rank_report
from jaxpar.train.launcher import run, start, supervise

# A rank that joined a job (watch_exit, as initialize() does) and holds a non-daemon thread, as an async save
# waiting on its peer would: an error must still end it at once, with its code.
EXITS = textwrap.dedent(f"""
    import importlib.util, sys, threading, time
    spec = importlib.util.spec_from_file_location("rank_report", {rank_report.__file__!r})
    rank_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rank_report)
    mode = sys.argv[1]
    if mode == "main":  # the usual `sys.exit(main())`: its sys.exit is looked up before main() joins the job
        def main():
            rank_report.watch_exit()
            threading.Thread(target=time.sleep, args=(60,)).start()
            return 2
        sys.exit(main())
    rank_report.watch_exit()
    if mode == "caught":  # a sys.exit that is caught is not the end; the program ends normally
        try:
            sys.exit(3)
        except SystemExit:
            pass
        print("went on", flush=True)
        sys.exit(0)
    threading.Thread(target=time.sleep, args=(60,)).start()
    print("stepping", flush=True)
    class Closing:
        def __enter__(self): return self
        def __exit__(self, *exc): print("closed", flush=True)
    with Closing():
        if mode == "exit-3":
            sys.exit(3)
        if mode == "message":
            sys.exit("my_train: bad data")
        if mode == "raise":
            raise ValueError("boom")
""")


@pytest.mark.parametrize("mode, code, out, err", [
    ("exit-3", 3, "stepping\nclosed\n", ""),
    ("raise", 1, "stepping\nclosed\n", "ValueError: boom\n"),
    ("message", 1, "stepping\nclosed\n", "my_train: bad data\n"),
    ("caught", 0, "went on\n", ""),
    ("main", 2, "", ""),
])
def test_an_error_ends_a_joined_rank_at_once_with_its_code(mode, code, out, err):
    """The code of sys.exit(n) or of an uncaught exception, printed as Python prints it, `with` blocks closed, but
    not held by a non-daemon thread (nor, in a real rank, by jax's shutdown barrier); a caught sys.exit is not it."""
    began = time.monotonic()
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": "localhost:1"}  # in a job: sys.exit watched from the import on
    done = subprocess.run([sys.executable, "-c", EXITS, mode], capture_output=True, text=True, timeout=90, env=env)
    assert (done.returncode, done.stdout) == (code, out), done.stderr
    assert done.stderr == err if not err else done.stderr.endswith(err) and done.stderr.count(err) == 1, done.stderr
    assert time.monotonic() - began < 30  # the non-daemon thread sleeps 60 s


def test_a_rank_in_checkpoint_code_says_so_in_its_sign_of_life():
    """The sign-of-life thread reads the main thread's stack: a frame of the checkpoint modules means CHECKPOINT."""
    space = {"__name__": "jaxpar.train.checkpoint"}
    exec(compile("def save(probe):\n    return probe()\n", "checkpoint.py", "exec"), space)
    assert space["save"](lambda: rank_report.doing(sys._getframe())) == rank_report.CHECKPOINT
    space = {"__name__": "orbax.checkpoint.checkpoint_manager"}
    exec(compile("def wait(probe):\n    return probe()\n", "checkpoint_manager.py", "exec"), space)
    assert space["wait"](lambda: rank_report.doing(sys._getframe())) == rank_report.CHECKPOINT
    assert rank_report.doing(sys._getframe()) == ""


# A rank stepping every 0.05 s with a sign of life; after step 5 it is in checkpoint code for 3 s (a save), as its
# sign of life says; then it steps on to 20 and finishes.
SAVES = """
import os, threading, time
from pathlib import Path
beat = Path(os.environ["JAXPAR_HEARTBEAT_FILE"])
doing = [""]
def live():
    while True:
        beat.with_suffix(".alive").write_text(doing[0])
        time.sleep(0.5)
threading.Thread(target=live, daemon=True).start()
for step in range(1, 21):
    beat.write_text(str(step))
    time.sleep(0.05)
    if step == 5:
        doing[0] = "checkpoint"
        time.sleep(3)
        doing[0] = ""
"""


def test_a_save_is_neither_a_step_nor_a_silence(tmp_path):
    """A 3 s save under a 1.5 s heartbeat does not end the job, and the slowest step (the default heartbeat's
    measure) is a step's, not the save's (it was 3 s: a 9.9 s save made the default heartbeat 99 s)."""
    ranks = start([[sys.executable, "-c", SAVES]], [dict(os.environ)], tmp_path / "logs", tmp_path / "logs")
    assert supervise(ranks, grace_s=1, heartbeat_s=1.5) == 0
    assert ranks[0].step() == 20
    assert 0 < ranks[0].slowest_step_s < 1.0, ranks[0].slowest_step_s


# A rank that shows life, then stops (SIGSTOP) before its first step; or one that lives and waits.
STALLS = """
import os, signal, sys, threading, time
from pathlib import Path
life = Path(os.environ["JAXPAR_HEARTBEAT_FILE"]).with_suffix(".alive")
def live():
    while True:
        life.touch()
        time.sleep(0.5)
threading.Thread(target=live, daemon=True).start()
time.sleep(0.6)
if sys.argv[1] == "stops":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


def test_a_rank_hung_before_its_first_step_is_named(tmp_path, capfd):
    """Start-up and compilation are not timed, but a rank without a sign of life for the heartbeat is hung."""
    ranks = start([[sys.executable, "-c", STALLS, mode] for mode in ("waits", "stops")], [dict(os.environ)] * 2,
                  tmp_path / "logs", tmp_path / "logs")
    watchdog = threading.Timer(30, lambda: [r.process.kill() for r in ranks])  # the old launcher waited forever
    watchdog.start()
    try:
        assert supervise(ranks, grace_s=1, heartbeat_s=2) == 128 + signal.SIGKILL
    finally:
        watchdog.cancel()
    assert "jaxpar launch: rank 1 hung before its first step: no sign of life for 2 s (heartbeat 2 s)" in \
        capfd.readouterr().err


ARGPARSE = """
import argparse, os, time
if os.environ["JAX_PROCESS_ID"] == "1":
    argparse.ArgumentParser(prog="my_train").parse_args(["--bogus-flag", "1"])
time.sleep(60)
"""


@pytest.mark.parametrize("logs", ["kept", "temporary"])
def test_a_rank_with_a_bad_command_line_shows_its_error(tmp_path, capfd, logs):
    """An argparse error on rank 1 alone: its usage and error lines (from rank1.err, kept or temporary), not only
    "rank 1 exited with code 2 before its first step"; no restart."""
    envs = [{**os.environ, "JAX_PROCESS_ID": str(rank)} for rank in (0, 1)]
    log_dir = tmp_path / "logs" if logs == "kept" else None
    starts = []

    def start_ranks():
        starts.append(1)
        return start([[sys.executable, "-c", ARGPARSE]] * 2, envs, log_dir, tmp_path / "beats")

    assert run(start_ranks, max_restarts=1, grace_s=1) == 2
    err = capfd.readouterr().err
    where = (log_dir or tmp_path / "beats") / "rank1.err"
    assert f"error: rank 1 exited with code 2 before its first step; its stderr ended with ({where}):" in err, err
    assert "  usage: my_train [-h]\n  my_train: error: unrecognized arguments: --bogus-flag 1\n" in err, err
    assert len(starts) == 1


def flaky(tmp_path):
    """Rank 1 SIGKILLs itself on the first start; the restart finishes."""
    script = ("import os, signal, sys\nfrom pathlib import Path\nmark = Path(sys.argv[1])\n"
              "if os.environ['JAX_PROCESS_ID'] == '1' and not mark.exists():\n"
              "    mark.touch(); os.kill(os.getpid(), signal.SIGKILL)\n")
    envs = [{**os.environ, "JAX_PROCESS_ID": str(rank)} for rank in (0, 1)]
    return lambda: start([[sys.executable, "-c", script, str(tmp_path / "died")]] * 2, envs, tmp_path / "logs")


def test_a_restart_forks_no_multithreaded_process(tmp_path):
    """The launcher has imported jax (and read a checkpoint: a backend and its threads); starting the ranks runs
    no fork hook (no preexec_fn), so jax's "os.fork() ... JAX is multithreaded" warning never comes."""
    import jax

    jax.devices()  # jax arms its fork warning with its first backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(flaky(tmp_path), max_restarts=1, grace_s=1) == 0
    assert not [str(w.message) for w in caught if "fork" in str(w.message)]


def _free_port():
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_jax_coordinator_port_is_the_launchs_port(monkeypatch, capfd):
    """JAX_COORDINATOR_PORT (which the port-in-use message suggests) is honoured; --coordinator-port wins."""
    from jaxpar.cli import main

    port, given = _free_port(), _free_port()
    monkeypatch.setenv("JAX_COORDINATOR_PORT", str(port))
    show = [sys.executable, "-c", "import os; print(os.environ['JAX_COORDINATOR_ADDRESS'])"]
    assert main(["launch", "-n", "1", "--", *show]) == 0
    assert capfd.readouterr().out == f"localhost:{port}\n"
    assert main(["launch", "-n", "1", "--coordinator-port", str(given), "--", *show]) == 0
    assert capfd.readouterr().out == f"localhost:{given}\n"
    with socket.socket() as held:
        held.bind(("localhost", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("JAX_COORDINATOR_PORT", str(port))
        assert main(["launch", "-n", "1", "--", *show]) == 2
    assert capfd.readouterr().err == (f"error: coordinator port {port} is in use (another job on "
                                      "this node?): choose another with `jaxpar launch --coordinator-port N` or "
                                      "JAX_COORDINATOR_PORT=N\n")
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "abc")
    assert main(["launch", "-n", "1", "--", *show]) == 2
    assert capfd.readouterr().err == "error: JAX_COORDINATOR_PORT='abc' is not a port number (1-65535)\n"

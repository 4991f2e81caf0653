"""examples/train_loop.py under `jaxpar launch -n 2 --devices-per-process 4`: SIGTERMed, killed and resumed, it
matches its uninterrupted losses bitwise, and a killed rank is reported as a `jaxpar train` rank is.

One job runs the 8 steps through; the other is stopped by SIGTERM to the launcher (both ranks save the step
they agree on and exit 0), resumed, has rank 1 SIGKILLed (the launcher's death report names it and the last
complete checkpoint), and is resumed again to the end. Losses come from each job's metrics file, which holds
each step once.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_loop.py"
STEPS = 8


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    words = "the a model trains on packed documents with jaxpar and flax loops resume exactly".split()
    path.write_text("".join(json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 37))})
                            + "\n" for i in range(400)))
    return path


def command(documents, directory: Path) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4",
            "--log-dir", str(directory / "logs"), "--", sys.executable, str(EXAMPLE), "--data", str(documents),
            "--steps", str(STEPS), "--seq-len", "32", "--save-every", "2", "--checkpoint-dir", str(directory / "ck"),
            "--metrics", str(directory / "metrics.jsonl")]


def losses(directory: Path) -> dict[int, float]:
    """step -> loss of the job's metrics file (its complete lines: the job may be writing the next)."""
    path = directory / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    rows = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    assert len({row["step"] for row in rows}) == len(rows), "a step written twice"
    return {row["step"]: row["loss"] for row in rows}


def until_step(launcher: subprocess.Popen, directory: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while max(losses(directory), default=0) < step:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if str(EXAMPLE) in child.cmdline() and child.environ().get("JAX_PROCESS_ID") == str(rank):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no rank {rank} of the example under the launcher")


def test_train_loop_example_stopped_killed_and_resumed_matches_its_uninterrupted_losses(documents, tmp_path):
    through, stopped = tmp_path / "through", tmp_path / "stopped"
    done = subprocess.run(command(documents, through), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all-reduce" in done.stdout and "memory per device" in done.stdout  # the step's inspection, once
    want = losses(through)
    assert sorted(want) == list(range(1, STEPS + 1))

    launcher = subprocess.Popen(command(documents, stopped), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until_step(launcher, stopped, 2)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0 and "SIGTERM forwarded; every rank saved and exited 0" in err, err[-3000:]
    first = max(losses(stopped))
    assert first < STEPS

    launcher = subprocess.Popen(command(documents, stopped), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until_step(launcher, stopped, first + 2)
    os.kill(rank_pid(launcher, 1), signal.SIGKILL)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    report = err[err.index("jaxpar launch: rank 1"):]
    assert "rank 1 was killed by SIGKILL" in report and "no process of the job remains" in report
    assert f"last complete checkpoint: step " in report and str(stopped / "ck") in report

    done = subprocess.run(command(documents, stopped), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = losses(stopped)
    print(f"stopped at step {first}, killed past step {first + 2}; losses {got}")
    assert got == want  # every step once, bitwise

"""A SIGKILL in the middle of an asynchronous save leaves the previous checkpoint complete and restorable.

`jaxpar train --save-every 1` saves every step, so a kill lands in a save; each
kill point is checked to have caught a step half-written (Orbax's temporary
directory), and the newest complete step must be the one before it, read back
whole (export reads every parameter array and checks its checksum).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST_COMPILE
from jaxpar.cli import main
from jaxpar.train.checkpoint import TEMPORARY
from jaxpar.train.launcher import last_complete_checkpoint


@pytest.mark.parametrize("rows, delay_s", [(3, 0.0), (5, 0.05)])
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path, capsys, rows, delay_s):
    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ck"
    command = [sys.executable, "-m", "jaxpar.cli", "train", "--mesh", "data=8", "--steps", "200", "--batch-size", "8",
               "--seq-len", "32", "--checkpoint-dir", str(directory), "--save-every", "1", "--metrics", str(metrics)]
    train = subprocess.Popen(command, env={**os.environ, "XLA_FLAGS": FAST_COMPILE}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not metrics.exists() or len(metrics.read_text().splitlines()) < rows:
        assert train.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(delay_s)
    train.send_signal(signal.SIGKILL)
    train.wait()
    half_written = [int(p.name.split(".")[0]) for p in directory.iterdir() if TEMPORARY in p.name]
    assert half_written, "the kill did not land in a save; this kill point tests nothing"
    latest = last_complete_checkpoint(str(directory))
    assert latest == max(half_written) - 1
    capsys.readouterr()
    assert main(["export", "--checkpoint-dir", str(directory), "--out", str(tmp_path / "p.npz")]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == latest  # read whole, checksums verified

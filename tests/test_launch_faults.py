"""The launcher's fault path: a dead rank is named (with its signal) and its peers are stopped."""

import os
import signal
import subprocess
import sys
import time

from jaxpar.train.distributed import _wait_all, describe_exit


def test_describe_exit_names_rank_and_signal():
    assert describe_exit(1, -signal.SIGKILL) == "rank 1 was killed by SIGKILL"
    assert describe_exit(0, 3) == "rank 0 exited with code 3"


def test_sigkilled_rank_stops_its_peers(capsys):
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    os.kill(sleepers[1].pid, signal.SIGKILL)
    start = time.monotonic()
    code = _wait_all(sleepers)
    assert time.monotonic() - start < 5
    assert code == 128 + signal.SIGKILL
    assert all(child.poll() is not None for child in sleepers)
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err

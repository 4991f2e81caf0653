"""Ranks started ahead of a restart (train/ranks.py's Spares): a restart takes them, with its own coordinator, and
only where they were started for the same command; the unused ones end."""

import os
import sys

from jaxpar.train.ranks import Spares, start


def status_command(directory) -> list[str]:
    """A `jaxpar` rank that ends at once (its imports are a rank's): `launch --status` of a folder with no events."""
    return [sys.executable, "-m", "jaxpar.cli", "launch", "--status", str(directory)]


def envs(address: str) -> list[dict]:
    return [{**os.environ, "JAX_COORDINATOR_ADDRESS": address, "JAX_PROCESS_ID": str(r)} for r in range(2)]


def test_a_restart_takes_the_ranks_started_ahead(tmp_path):
    spares = Spares(restarts=1)
    command = status_command(tmp_path / "nothing")
    first = start([command] * 2, envs("localhost:1"), tmp_path / "logs", tmp_path / "logs", spares)
    ahead = [rank.process.pid for _, rank in spares.ready]
    assert len(ahead) == 2 and not set(ahead) & {rank.process.pid for rank in first}
    for rank in first:
        assert rank.process.wait(timeout=120) == 2
    second = start([command] * 2, envs("localhost:2"), tmp_path / "logs", tmp_path / "logs", spares)
    assert [rank.process.pid for rank in second] == ahead  # taken, not started again
    assert spares.ready == []  # no restart is left: none started for a third start
    for rank in second:
        assert rank.process.wait(timeout=120) == 2
    assert "events.jsonl" in second[1].error_lines()[-1]  # ran the command, its own lines only (not the first's)
    assert len(second[1].error_lines()) == 1


def test_a_spare_started_for_another_command_is_not_taken_and_ends(tmp_path):
    spares = Spares(restarts=2)
    first = start([status_command(tmp_path / "a")] * 2, envs("localhost:1"), tmp_path / "logs", tmp_path / "logs",
                  spares)
    unused = [rank for _, rank in spares.ready]
    second = start([status_command(tmp_path / "b")] * 2, envs("localhost:2"), tmp_path / "logs",
                   tmp_path / "logs", spares)  # a shrunk job's command differs: started afresh
    assert not {r.process.pid for r in unused} & {r.process.pid for r in second}
    assert all(rank.process.poll() is not None for rank in unused)
    spares.close()
    for rank in [*first, *second]:
        assert rank.process.wait(timeout=120) == 2

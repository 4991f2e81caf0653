"""Start-up time of a restarted and of a repeated run (issue 55's acceptance), and where the seconds go.

restart: SIGKILL rank 1 of `jaxpar launch -n 2 --devices-per-process 4 --max-restarts 1 train --mesh data=8 ...`
(checkpoints every 5 steps) after step 7; the seconds from the kill to the restarted job's first new step (the
metrics file's next row), and whether every step's loss equals an uninterrupted run's (which ran first, with the
same compile cache). Target: <= 10 s.
rerun: the same config as one `jaxpar train --devices 8` twice, each into a fresh directory, the first with an
empty compile cache: the seconds from the process's start to its first step, the second's over the first's.
Target: <= 0.2.

Each phase is read from the processes' own milestones (jaxpar.core.timeline: JAXPAR_TIMELINE) and the launcher's.
Usage: python benchmarks/restart.py [--skip-rerun] [--skip-restart]   (prints one JSON object)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

TRAIN = ["train", "--mesh", "data=8", "--steps", "16", "--batch-size", "8", "--seq-len", "64"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events(path: Path, since: float = 0.0) -> list[dict]:
    return [e for e in rows(path) if e["time"] >= since]


def phases(marks: list[dict], origin: float) -> dict:
    """Seconds from `origin` to each milestone (the first of each name; a rank's as `name (rank N)`)."""
    out = {}
    for mark in sorted(marks, key=lambda m: m["time"]):
        name = mark["event"] if mark["rank"] in (None, "0") or mark["event"].startswith("launcher") \
            else f"{mark['event']} (rank {mark['rank']})"
        out.setdefault(name, round(mark["time"] - origin, 2))
    return out


def launched(tmp: Path, name: str, env: dict) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4",
            "--max-restarts", "1", *TRAIN, "--save-every", "5", "--checkpoint-dir", str(tmp / name / "ckpt"),
            "--metrics", str(tmp / name / "m.jsonl")]


def restart(tmp: Path, env: dict) -> dict:
    through_env = {**env, "JAXPAR_TIMELINE": str(tmp / "through.timeline")}
    began = time.time()
    through = subprocess.run(launched(tmp, "through", env), env=through_env, capture_output=True, text=True)
    uninterrupted = time.time() - began
    assert through.returncode == 0, through.stderr[-2000:]
    timeline = tmp / "killed.timeline"
    launcher = subprocess.Popen(launched(tmp, "killed", env), env={**env, "JAXPAR_TIMELINE": str(timeline)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp / "killed" / "m.jsonl"
    while max((r["step"] for r in rows(metrics)), default=0) < 7:
        assert launcher.poll() is None, launcher.communicate()[1][-2000:]
        time.sleep(0.02)
    victim = next(c for c in psutil.Process(launcher.pid).children(recursive=True)
                  if c.environ().get("JAX_PROCESS_ID") == "1" and "jaxpar.cli" in " ".join(c.cmdline()))
    before = len(rows(metrics))
    killed_at = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    while len(rows(metrics)) <= before:
        time.sleep(0.02)
    first_new = time.time() - killed_at
    out, err = launcher.communicate(timeout=600)
    a = {r["step"]: r["loss"] for r in rows(tmp / "through" / "m.jsonl")}
    b = {r["step"]: r["loss"] for r in rows(metrics)}  # a step run again after the restart: its last row
    return {"uninterrupted_run_s": round(uninterrupted, 1), "kill_to_first_new_step_s": round(first_new, 2),
            "exit": launcher.returncode, "steps": sorted(b) == sorted(a),
            "losses_equal": sorted(a) == sorted(b) and all(a[s] == b[s] for s in a),
            "step_loaded": "loaded from the compile cache" in out + err,
            "after_kill_s": phases(events(timeline, killed_at), killed_at)}


def one_run(tmp: Path, name: str, env: dict) -> tuple[float, dict]:
    timeline = tmp / f"{name}.timeline"
    (tmp / name).mkdir()
    began = time.time()
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", *TRAIN, "--devices", "8",
                           "--metrics", str(tmp / name / "m.jsonl")],
                          env={**env, "JAXPAR_TIMELINE": str(timeline)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    marks = phases(events(timeline), began)
    return marks["first step"], {**marks, "source": next((line.split("step ", 1)[1] for line in done.stdout.splitlines()
                                                          if line.startswith("step loaded") or
                                                          line.startswith("step compiled")), None)}


def rerun(tmp: Path, env: dict) -> dict:
    first, first_phases = one_run(tmp, "first", env)
    second, second_phases = one_run(tmp, "second", env)
    return {"first_run_to_first_step_s": round(first, 2), "second_run_to_first_step_s": round(second, 2),
            "second_over_first": round(second / first, 3), "first_s": first_phases, "second_s": second_phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-rerun", action="store_true")
    parser.add_argument("--skip-restart", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "JAXPAR_COMPILE_CACHE": os.environ.get("JAXPAR_COMPILE_CACHE") or str(tmp / "cache")}
    out = {"load_average": os.getloadavg()[0]}
    if not args.skip_rerun:
        out["rerun"] = rerun(tmp, {**env, "JAXPAR_COMPILE_CACHE": str(tmp / "rerun-cache")})
    if not args.skip_restart:
        out["restart"] = restart(tmp, env)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

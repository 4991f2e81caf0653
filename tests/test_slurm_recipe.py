"""The README's Slurm script decides from this attempt alone: a requeue from the attempt's own preemption marker (not
from logs that append over attempts), and the layout from the nodes this allocation has (elastic `--nodes=2-4`).

It runs as written, with the real `jaxpar launch --shrink-to` and stand-ins for `srun` (records what it was asked to
run; an attempt that is preempted or finishes, as `jaxpar train` would: a line in the appended log, and the marker for
a preemption save) and `scontrol` (records its call).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$SRUN_ARGS"
echo "$FAKE_OUTCOME" >> "logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-rank0.out"
if [ "$FAKE_OUTCOME" = "preempted (SIGTERM): step 500 saved" ]; then echo 500 > "$CKPT/PREEMPTED"; fi
"""
PREEMPTED, FINISHED = "preempted (SIGTERM): step 500 saved", "done: loss 2.1 -> 1.3"


def slurm_script() -> str:
    text = README.read_text()
    section = text[text.index("### Slurm"):]
    return section[section.index("```bash\n") + len("```bash\n"):section.index("\n```", section.index("```bash"))]


def attempt(tmp_path, outcome, nodes=4, code=0):
    """One run of the job script under the same job id on `nodes` nodes: the `scontrol` calls it made, what it asked
    `srun` to run (None when it ran nothing) and its stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$CALLS"\n')
    (bin_dir / "jaxpar").write_text(f'#!/bin/bash\nexec {sys.executable} -m jaxpar.cli "$@"\n')
    for tool in ("srun", "scontrol", "jaxpar"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(slurm_script())
    calls, srun_args = tmp_path / "calls", tmp_path / "srun_args"
    calls.unlink(missing_ok=True)
    srun_args.unlink(missing_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CKPT": str(tmp_path / "ck"), "CALLS": str(calls),
           "SRUN_ARGS": str(srun_args), "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "jaxpar-7b",
           "SLURM_JOB_NUM_NODES": str(nodes), "FAKE_OUTCOME": outcome}
    done = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    ran = srun_args.read_text().splitlines() if srun_args.exists() else None
    return calls.read_text().splitlines() if calls.exists() else [], ran, done.stderr


def flag(args, name):
    """The value of `name` in an argument list: the last one given, as `jaxpar train` reads it."""
    return [args[i + 1] for i, arg in enumerate(args) if arg == name][-1]


def test_a_preempted_attempt_requeues_and_a_finished_one_does_not(tmp_path):
    assert attempt(tmp_path, PREEMPTED)[0] == ["requeue 77"]
    assert attempt(tmp_path, FINISHED)[0] == []  # the requeued attempt finished
    log = (tmp_path / "logs" / "jaxpar-7b-77-rank0.out").read_text()
    assert "preempted (SIGTERM)" in log  # the earlier attempt's line is still in the appended log
    assert not (tmp_path / "ck" / "PREEMPTED").exists()


def test_the_full_allocation_runs_the_command_as_written(tmp_path):
    calls, ran, stderr = attempt(tmp_path, FINISHED, nodes=4)
    split = ran.index("jaxpar")
    assert ran[:2] == ["--nodes=4", "--ntasks=4"]
    assert ran[split + 1:] == ["train", "--config", "runs/7b.toml", "--mesh", "replica=4,data=8", "--zero", "3",
                               "--grad-accum", "1", "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "500",
                               "--steps", "100000"]
    assert calls == [] and stderr == ""


def test_fewer_nodes_run_the_same_layout_with_a_smaller_data_axis_and_more_accumulation(tmp_path):
    """Half the nodes: data halved, grad-accum doubled, the same checkpoint dir (jaxpar train resumes from it onto
    the smaller mesh); 3 of 4 nodes run on 2, the largest count the layout divides by. A preemption still requeues."""
    for nodes in (2, 3):
        calls, ran, stderr = attempt(tmp_path, PREEMPTED, nodes=nodes)
        train = ran[ran.index("jaxpar") + 1:]
        assert ran[:2] == ["--nodes=2", "--ntasks=2"]
        assert (flag(train, "--mesh"), flag(train, "--grad-accum")) == ("replica=4,data=4", "2")
        assert flag(train, "--checkpoint-dir") == str(tmp_path / "ck")
        assert [flag(train, name) for name in ("--config", "--zero", "--steps")] == ["runs/7b.toml", "3", "100000"]
        assert stderr.splitlines() == [f"jaxpar launch: {nodes} of 4 processes; shrinking: processes 4 -> 2, "
                                       "mesh replica=4,data=8 -> replica=4,data=4, grad-accum 1 -> 2"]
        assert calls == ["requeue 77"]


def test_fewer_nodes_than_the_minimum_stop_with_one_line_and_no_requeue(tmp_path):
    attempt(tmp_path, PREEMPTED)  # an earlier attempt was preempted: its marker is there
    calls, ran, stderr = attempt(tmp_path, PREEMPTED, nodes=1, code=2)
    assert ran is None and calls == []
    assert stderr.splitlines() == [
        "error: the job cannot shrink from 4 processes: 1 processes left, fewer than --min-processes 2"]


def test_the_script_parses():
    assert subprocess.run(["bash", "-n"], input=slurm_script(), text=True).returncode == 0

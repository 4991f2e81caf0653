"""The README's Slurm script decides on a requeue from this attempt alone, not from logs that append over attempts.

It runs as written, with stand-ins for `srun` (an attempt that is preempted or finishes, as `jaxpar train`
would: a line in the appended log, and the marker for a preemption save) and `scontrol` (records its call).
"""

import os
import subprocess
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

SRUN = """#!/bin/bash
echo "$FAKE_OUTCOME" >> "logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-rank0.out"
if [ "$FAKE_OUTCOME" = "preempted (SIGTERM): step 500 saved" ]; then echo 500 > "$CKPT/PREEMPTED"; fi
"""


def slurm_script() -> str:
    text = README.read_text()
    section = text[text.index("### Slurm"):]
    return section[section.index("```bash\n") + len("```bash\n"):section.index("\n```", section.index("```bash"))]


def attempt(tmp_path, outcome) -> list[str]:
    """One run of the job script under the same job id; the `scontrol` calls it made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$CALLS"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(slurm_script())
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (tmp_path / "ck").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CKPT": str(tmp_path / "ck"), "CALLS": str(calls),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "jaxpar-7b", "FAKE_OUTCOME": outcome}
    done = subprocess.run(["bash", "job.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return calls.read_text().splitlines() if calls.exists() else []


def test_a_preempted_attempt_requeues_and_a_finished_one_does_not(tmp_path):
    assert attempt(tmp_path, "preempted (SIGTERM): step 500 saved") == ["requeue 77"]
    assert attempt(tmp_path, "done: loss 2.1 -> 1.3") == []  # the requeued attempt finished
    log = (tmp_path / "logs" / "jaxpar-7b-77-rank0.out").read_text()
    assert "preempted (SIGTERM)" in log  # the earlier attempt's line is still in the appended log
    assert not (tmp_path / "ck" / "PREEMPTED").exists()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n"], input=slurm_script(), text=True).returncode == 0

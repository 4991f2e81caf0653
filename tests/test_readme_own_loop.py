"""The README's own training loop runs as written; stopped after step 12 (its last checkpoint step 10) and run
again, it resumes from step 10 and finishes, each metrics row once. (That a resume is bit for bit the
uninterrupted run is tests/test_public_checkpoint.py's.)"""

import json
import math
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _loop_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (loop,) = [b for b in blocks if "Checkpoints(" in b]
    return loop


def _checkpoint_steps() -> list[int]:
    return sorted(int(p.name) for p in Path("my_run/ck").iterdir() if p.name.isdigit())


def test_the_readme_loop_runs_stops_and_resumes(tmp_path, monkeypatch, capsys):
    block = _loop_block()
    assert "steps, rows, seq = 20," in block
    monkeypatch.chdir(tmp_path)
    exec(compile(block.replace("steps, rows, seq = 20,", "steps, rows, seq = 12,"), str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "collectives per device per step" in out and "step    10  loss" in out
    assert _checkpoint_steps() == [10]
    exec(compile(block, str(README), "exec"), {})  # as written: resumes from step 10
    assert "step    20  loss" in capsys.readouterr().out
    rows = [json.loads(line) for line in Path("my_run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))  # steps 11 and 12 of the first run dropped, run again
    assert all(math.isfinite(r["loss"]) for r in rows) and _checkpoint_steps() == [10, 20]

"""`jaxpar launch -n 2 ... export --format hf`: a checkpoint saved by two processes is exported by both together.

A tiny Llama is trained one step by two processes of 4 devices (data=2,pipe=2,tensor=2) and exported by two
processes: each writes one safetensors file of its share of the tensors
(disjoint, together all of them), process 0 the index naming every file once both are written. The tensors are
bitwise those of the one-process export, and transformers reloads the directory strictly.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import FAST_COMPILE
from jaxpar.cli import main
from jaxpar.interop import export_shares
from safetensors.numpy import load_file

LAUNCH = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "4"]
INDEX = "model.safetensors.index.json"


def launch(*argv: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*LAUNCH, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XLA_FLAGS": FAST_COMPILE})  # launch gives each process its devices
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(checkpoint saved by 2 processes, its export by 2 processes, its export by 1, each rank's summary)."""
    work = tmp_path_factory.mktemp("launch-export")
    launch("train", "--mesh", "data=2,pipe=2,tensor=2", "--steps", "1", "--batch-size", "8", "--seq-len", "16",
           "--checkpoint-dir", str(work / "run"), "--save-every", "1")
    done = launch("--log-dir", str(work / "logs"), "export", "--checkpoint-dir", str(work / "run"),
                  "--out", str(work / "two"), "--format", "hf")
    summaries = [json.loads(done.stdout.strip().splitlines()[-1]),
                 json.loads((work / "logs" / "rank1.out").read_text().strip().splitlines()[-1])]
    assert main(["export", "--checkpoint-dir", str(work / "run"), "--out", str(work / "one"), "--format", "hf"]) == 0
    return work / "run", work / "two", work / "one", summaries


def test_each_process_writes_its_own_disjoint_share_and_process_0_the_index(exports):
    _, two, _, summaries = exports
    files = sorted(p.name for p in two.glob("*.safetensors"))
    assert [s["written"] for s in summaries] == [[files[0]], [files[1]]]
    assert [s["process"] for s in summaries] == [0, 1]
    names = [set(load_file(two / file)) for file in files]
    assert names[0] and names[1] and not names[0] & names[1]
    weight_map = json.loads((two / INDEX).read_text())["weight_map"]
    assert weight_map == {name: file for file, held in zip(files, names) for name in held}
    # layer by layer: the first process's layers all come before the second's
    layers = [{int(n.split(".")[2]) for n in held if n.startswith("model.layers.")} for held in names]
    assert max(layers[0]) <= min(layers[1])


def test_the_two_process_export_is_bitwise_the_one_process_export(exports):
    _, two, one, _ = exports
    ours = {k: v for p in two.glob("*.safetensors") for k, v in load_file(p).items()}
    theirs = load_file(one / "model.safetensors")
    assert set(ours) == set(theirs)
    assert all(ours[k].dtype == theirs[k].dtype and ours[k].tobytes() == theirs[k].tobytes() for k in theirs)
    assert json.loads((two / "config.json").read_text()) == json.loads((one / "config.json").read_text())


def test_transformers_reloads_the_two_process_export_strictly(exports):
    transformers = pytest.importorskip("transformers")
    _, two, one, _ = exports
    model, info = transformers.LlamaForCausalLM.from_pretrained(two, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    expected = load_file(one / "model.safetensors")
    state = model.state_dict()
    assert all(np.array_equal(state[k].numpy(), v) for k, v in expected.items())


def test_shares_are_contiguous_disjoint_and_about_equal():
    shapes = {f"t{i}": (10 + i, 4) for i in range(12)}
    runs = export_shares.shares(shapes, 4, 3)
    assert [name for run in runs for name in run] == list(shapes)  # in order, each once
    sizes = [sum(np.prod(s) * 4 for s in run.values()) for run in runs]
    assert max(sizes) - min(sizes) <= 2 * max(np.prod(s) * 4 for s in shapes.values())


def test_other_formats_under_several_processes_are_refused_in_one_line(exports, tmp_path, monkeypatch, capsys):
    run, _, _, _ = exports
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    for form in ("jaxpar", "peft"):
        assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / form), "--format", form]) == 2
        assert capsys.readouterr().err.strip() == (f"error: export --format {form} is written by one process; "
                                                   "only --format hf is written by several (`jaxpar launch`)")
    assert not list(tmp_path.iterdir())

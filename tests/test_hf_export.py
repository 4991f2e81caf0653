"""What a fine-tuned Hugging Face model's checkpoint keeps: the model it holds, and its source config on export.

A tiny Mixtral (module fixture) is imported and trained one step from `--init-from`; its checkpoint names the
MoE model, so `generate` and `eval` read it, and its export writes the source `config.json` back field by field.
"""

import json

import pytest

from jaxpar.cli import main
from test_hf import needs_torch, saved_family
from test_hf_mixtral import family_model as mixtral_model


def run_json(argv, capsys) -> dict:
    """The one JSON object a `--json` command prints (exit status 0 asserted)."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained_mixtral(tmp_path_factory):
    """(save_pretrained directory, import-hf directory, checkpoint directory of 1 step trained from --init-from)."""
    _, _, directory = saved_family("mixtral", mixtral_model, tmp_path_factory)
    work = directory.parent
    assert main(["import-hf", str(directory), "--out", str(work / "imported")]) == 0
    assert main(["train", "--init-from", str(work / "imported"), "--mesh", "data=4,expert=2", "--steps", "1",
                 "--batch-size", "8", "--seq-len", "16", "--checkpoint-dir", str(work / "run"),
                 "--save-every", "1"]) == 0
    return directory, work / "imported", work / "run"


@needs_torch
def test_a_mixtral_trained_from_init_from_generates_and_evaluates(trained_mixtral, tmp_path, capsys):
    """The run config names `moe-tiny`, not the --model default; generate and eval on the checkpoint equal theirs
    on its Hugging Face export (the same weights read through the other door)."""
    from jaxpar.train.checkpoint import Checkpoints

    _, _, run = trained_mixtral
    with Checkpoints(run, read_only=True) as checkpoints:
        saved = checkpoints.metadata()["config"]
    assert (saved["model"]["name"], saved["train"]["model"]) == ("moe-tiny", "moe-tiny")
    assert saved["model"]["config"]["n_experts"] == 4
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0

    ask = ["--prompt", "The cat", "--max-new-tokens", "6"]
    generated = run_json(["generate", "--checkpoint-dir", str(run), *ask], capsys)
    assert generated["completions"] == run_json(["generate", "--checkpoint-dir", str(tmp_path / "hf"), *ask],
                                                 capsys)["completions"]
    assert generated["new_tokens"] == 6
    evaluated = run_json(["eval", "--checkpoint-dir", str(run), "--seq-len", "16"], capsys)
    exported = run_json(["eval", "--checkpoint-dir", str(tmp_path / "hf"), "--seq-len", "16"], capsys)
    assert evaluated["eval_tokens"] == exported["eval_tokens"] > 0
    assert abs(evaluated["eval_loss"] / exported["eval_loss"] - 1) <= 1e-5

"""`jaxpar train` and `jaxpar inspect` end to end, in process: metrics, equal losses across meshes, errors."""

import json

import pytest

from jaxpar.cli import main


def run_train(tmp_path, name, *flags):
    metrics = tmp_path / f"{name}.jsonl"
    code = main(["train", "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--metrics", str(metrics), *flags])
    assert code == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_metrics_file_and_same_losses_on_two_meshes(tmp_path):
    dp = run_train(tmp_path, "dp", "--mesh", "data=8")
    tp = run_train(tmp_path, "tp", "--mesh", "data=2,tensor=4", "--sequence-parallel")
    assert [row["step"] for row in dp] == [1, 2, 3, 4]
    assert {"loss", "tokens_per_s", "step_time_s", "grad_norm"} <= set(dp[0])
    for a, b in zip(dp, tp):
        assert abs(a["loss"] / b["loss"] - 1) <= 1e-5


def test_config_file_overrides(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[model]\nname = "tiny"\nd_model = 32\nhead_dim = 8\n[train]\nsteps = 2\n[mesh]\ndata = 8\n')
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--config", str(config), "--batch-size", "8", "--seq-len", "16", "--metrics", str(metrics)]) == 0
    assert len(metrics.read_text().splitlines()) == 2


def test_inspect_json(capsys):
    assert main(["inspect", "--mesh", "data=8", "--batch-size", "8", "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == 180800 and report["mesh"]["data"] == 8
    (row,) = report["collectives"]
    assert row["kind"] == "all-reduce" and row["axes"] == ["data"]
    assert set(report["memory"]) >= {"arguments", "outputs", "temp", "total"} and report["flops"] > 0
    # The compiled step's matmuls, loop trips counted, are the model FLOPs that MFU uses (6 N + attention per token)
    # and flash attention's recomputed scores.
    from helpers import flash_recomputed_flops
    from jaxpar.planner import mfu
    from jaxpar.models import model_config

    config = model_config("tiny", {"seq_len": 32})
    per_device = (mfu.model_flops_per_step("tiny", config, 8, 32) + flash_recomputed_flops(config, 8, 32)) / 8
    assert report["matmul_flops"] == pytest.approx(per_device, rel=0.01)


def test_inspect_shows_the_pipeline_it_compiles(capsys):
    """`jaxpar inspect` on a pipeline plan gives its bubble, live-microbatch bound and residual ring, read back from
    the step it compiles, in the JSON and in the table view."""
    flags = ["inspect", "--mesh", "data=4,pipe=2", "--microbatches", "4", "--batch-size", "16", "--seq-len", "32"]
    assert main([*flags, "--json"]) == 0
    pipe = json.loads(capsys.readouterr().out)["pipeline"]
    assert (pipe["schedule"], pipe["stages"], pipe["microbatches"], pipe["ring_rows"]) == ("1f1b", 2, 4, 2)
    assert pipe["bubble"] == pytest.approx(1 / 5) and pipe["peak_residual_bytes"] > 0
    assert main(flags) == 0
    assert "pipeline 1f1b: bubble 20.0%" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mesh", "data=3"], "has 3 devices but 8 are available"),
        (["--mesh", "data=4,model=2"], "unknown mesh axis 'model'"),
        (["--mesh", "data=8", "--batch-size", "12"], "global batch 12 does not divide"),
        (["--data", "/no/such/file.txt"], "does not exist"),
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--zero", "7"], "zero stage must be 0, 1, 2 or 3"),
    ],
)
def test_bad_input_fails_before_compiling(flags, message, capsys):
    assert main(["train", "--steps", "1", *flags]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_unknown_keys_in_config(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nstepz = 3\n")
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown [train] keys ['stepz']" in capsys.readouterr().err

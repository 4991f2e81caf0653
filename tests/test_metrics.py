"""--tensorboard event files read back by TensorBoard's own reader, and MFU: its formula, its peaks, and where it shows."""

import dataclasses
import io
import json
import re
import types

import jax
import jax.numpy as jnp
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxpar.planner import mfu
from jaxpar.planner.devices import device_peak
from jaxpar.cli import build_parser, main, resolve
from jaxpar.run.tensorboard import TensorBoard
from jaxpar.models import model_config
from jaxpar.core.plan import Plan
from jaxpar.run.report import train_with_progress
from jaxpar.run.training import TrainConfig, prepare

PEAK = 2.5e10  # FLOP/s per device, given with --peak-flops (the CPU has no datasheet peak)


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def train(run, **changes) -> str:
    """Train `run` with its config changed as given; returns what the progress printed, whitespace folded."""
    out = io.StringIO()
    assert train_with_progress(dataclasses.replace(run, config=dataclasses.replace(run.config, **changes)),
                               Console(file=out, width=100)) == 0
    return " ".join(out.getvalue().split())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny model trained twice from one initial state and one compiled step (compiling dominates the time):
    on the CPU as it is, and with --peak-flops, --metrics and --tensorboard."""
    tmp = tmp_path_factory.mktemp("run")
    config = TrainConfig(steps=3, batch_size=8, seq_len=32)
    prepared = prepare(config, Plan.create("data=8"))
    initial = prepared.init()
    prepared.init = lambda: jax.tree.map(jnp.copy, initial)  # the step donates its input state
    cpu = train(prepared)
    with_peak = prepare(dataclasses.replace(config, peak_flops=PEAK), prepared.plan)  # no compile: take its MFU
    prepared = dataclasses.replace(prepared, mfu=with_peak.mfu)
    prepared.init = lambda: jax.tree.map(jnp.copy, initial)
    printed = train(prepared, metrics=str(tmp / "m.jsonl"), tensorboard=str(tmp / "tb"))
    rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    return types.SimpleNamespace(rows=rows, board=scalars(tmp / "tb"), printed=printed, cpu=cpu)


def test_tensorboard_holds_the_metrics_file_rows(run):
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s", "perf/mfu"} \
        <= set(run.board)
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("perf/tokens_per_s", "tokens_per_s"), ("perf/mfu", "mfu")):
        assert [step for step, _ in run.board[tag]] == [1, 2, 3]
        assert [value for _, value in run.board[tag]] == pytest.approx([row[key] for row in run.rows], rel=1e-6)
    assert run.rows[0]["lr"] == 0.0 and run.rows[2]["lr"] > run.rows[1]["lr"] > 0  # warm-up


def test_flops_per_step_by_hand():
    # tiny: 180,800 parameters, of which the 256 x 64 embedding table is a lookup, not a matmul (the head is one);
    # attention's QK^T and AV are 2 x 2 s (h hd) FLOPs per token and layer forward, x3 with the backward.
    params, vocab, d, layers, heads, head_dim, seq, batch = 180_800, 256, 64, 4, 8, 8, 32, 8
    per_token = 6 * (params - vocab * d) + 3 * layers * 2 * 2 * seq * heads * head_dim
    assert per_token == 1_084_800
    assert mfu.model_flops_per_step("tiny", model_config("tiny", {"seq_len": seq}), batch, seq) == per_token * batch * seq


def test_cpu_shows_no_mfu(run):
    assert re.search(r"ms/step MFU n/a \(CPU\)", run.cpu) and re.search(r"done: .* MFU n/a \(CPU\)", run.cpu)
    assert not re.search(r"MFU \d", run.cpu)


def test_peak_flops_gives_mfu_by_the_formula(run):
    flops = 1_084_800 * 8 * 32
    for row in run.rows:
        assert row["mfu"] == pytest.approx(flops / (row["step_time_s"] * PEAK * 8), rel=1e-9)
    assert re.search(r"ms/step MFU \d+\.\d%", run.printed) and "n/a" not in run.printed  # the progress bar
    assert re.search(r"done: .* MFU \d+\.\d%", run.printed)  # and the closing line


def test_peaks_by_device_kind():
    assert device_peak("NVIDIA H100 80GB HBM3") == (989e12, "H100 SXM")
    assert device_peak("NVIDIA H100 PCIe")[0] == 756e12
    assert device_peak("NVIDIA H200")[0] == 989e12
    assert device_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == 156e12  # TF32: how JAX runs fp32 matmuls there
    assert device_peak("NVIDIA B200")[0] == 2.25e15
    assert device_peak("TPU v4")[0] == 275e12
    assert device_peak("TPU v5 lite")[0] == 197e12
    assert device_peak("TPU v5")[0] == 459e12
    assert device_peak("TPU v6 lite")[0] == 918e12
    assert device_peak("NVIDIA GeForce GTX 1080") is None and device_peak("TPU v4 lite") is None


def test_mfu_only_where_a_peak_is_known():
    config = model_config("tiny", {"seq_len": 32})
    h100 = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")] * 8
    cpu = [types.SimpleNamespace(platform="cpu", device_kind="cpu")] * 8
    odd = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA GeForce GTX 1080")]
    assert mfu.for_run("tiny", config, 8, 32, "bf16", h100)(1.0) == pytest.approx(1_084_800 * 256 / (8 * 989e12))
    assert mfu.for_run("tiny", config, 8, 32, "bf16", cpu)(1.0) is None
    assert mfu.for_run("tiny", config, 8, 32, "bf16", cpu).why_not == "n/a (CPU)"
    assert "--peak-flops" in mfu.for_run("tiny", config, 8, 32, "bf16", odd).why_not
    assert mfu.for_run("tiny", config, 8, 32, "bf16", cpu, peak_flops=1e12)(1.0) == pytest.approx(1_084_800 * 256 / 8e12)


def test_memory_and_eval_rows_get_their_groups(tmp_path):
    board = TensorBoard(tmp_path)
    board.write({"step": 5, "loss": 2.0, "memory_bytes_in_use": 1024, "memory_peak_bytes_in_use": 2048,
                 "eval_loss": 2.5, "nonfinite": 0, "saved": True, "eval_tokens": 10})
    board.close()
    read = scalars(tmp_path)
    assert set(read) == {"train/loss", "memory/bytes_in_use", "memory/peak_bytes_in_use", "eval/loss", "eval/tokens"}
    assert read["memory/peak_bytes_in_use"] == [(5, 2048.0)]


def test_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--peak-flops", "1.5e14", "--tensorboard", "tb", "--tokenizer", "t.model"])
    config = resolve(args)[0]
    assert (config.peak_flops, config.tensorboard, config.tokenizer) == (1.5e14, "tb", "t.model")


def test_bad_peak_flops_is_refused(capsys):
    assert main(["train", "--steps", "1", "--peak-flops", "0"]) == 2
    assert "peak_flops must be > 0" in capsys.readouterr().err

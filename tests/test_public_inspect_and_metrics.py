"""`jaxpar.inspect` and `jaxpar.metrics` on a loop of one's own: the README's MLP's compiled step read back against
its gradient bytes, and its rows written as `jaxpar train` writes them (JSON lines, TensorBoard, progress, MFU)."""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jaxpar
import jaxpar.inspect
from jaxpar.metrics import Metrics, mfu

WIDTH, HIDDEN, BATCH = 32, 128, 64


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(WIDTH, HIDDEN, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(HIDDEN, WIDTH, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def loss_fn(model, batch):
    return jax.numpy.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_inspect_reads_a_users_step_gradient_all_reduce_and_memory():
    plan = jaxpar.Plan.create("data=8")
    optimizer = optax.adamw(1e-2)
    model, _ = jaxpar.init_state(lambda: MLP(nnx.Rngs(0)), optimizer, plan)
    step = jaxpar.make_train_step(model, loss_fn, optimizer, plan)
    state = jaxpar.inspect.abstract_state(model, optimizer, plan)
    rows = jax.ShapeDtypeStruct((BATCH, WIDTH), np.float32, sharding=plan.sharding(plan.batch_spec(2)))
    report = jaxpar.inspect.inspect_step(step, state, {"x": rows, "y": rows})
    param_bytes = 4 * (2 * WIDTH * HIDDEN + HIDDEN + WIDTH)
    reduced = [r for r in report["collectives"] if r["kind"] == "all-reduce" and r["axes"] == ["data"]]
    # every gradient once over data, plus the few scalars (loss, gradient norm) the step reports
    assert param_bytes <= sum(r["bytes"] for r in reduced) <= param_bytes + 64, report["collectives"]
    assert report["memory"]["arguments"] >= 3 * param_bytes  # parameters and Adam's two moments, replicated
    assert report["matmul_flops"] > 0 and report["mesh"] == {a: 8 if a == "data" else 1 for a in report["mesh"]}
    with pytest.raises(ValueError, match="pass plan= or mesh="):
        jaxpar.inspect.inspect_step(jax.jit(lambda x: x), rows)
    console = Console(record=True, width=200)
    jaxpar.inspect.show(report, console)
    header = next(line for line in console.export_text().splitlines() if "kind" in line and "axes" in line)
    assert header.replace("┃", " ").split() == list(reduced[0]), "show() names the columns as the JSON does"


def test_metrics_rows_go_where_jaxpar_train_writes_them(tmp_path, capsys):
    utilization = mfu(1e8, devices=jax.devices()[:2], peak_flops=1e10)
    assert utilization(0.05) == pytest.approx(1e8 / (0.05 * 2e10))
    assert mfu(1e9).why_not == "n/a (CPU)"
    with Metrics(tmp_path / "m.jsonl", tmp_path / "tb", print_every=2, tokens_per_step=1000, mfu=utilization) as m:
        for step in (1, 2, 3):
            m.write({"step": step, "loss": jax.numpy.float32(4.0 - step), "step_time_s": 0.05})
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["loss"] == 2.0
    assert rows[0]["tokens_per_s"] == pytest.approx(20000) and rows[0]["mfu"] == pytest.approx(0.1)
    assert capsys.readouterr().out.splitlines() == ["step     2  loss 2.000000  mfu 0.1"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert "perf/mfu" in events.Tags()["scalars"]
    with Metrics(tmp_path / "m.jsonl", start=2, print_every=0) as m:  # resumed from step 2's checkpoint
        m.write({"step": 3, "loss": 0.5})
    assert [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()] == [3.0, 2.0, 0.5]

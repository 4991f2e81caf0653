"""`jaxpar plan --scaling`: the planner's weak and strong scaling table, and the two-host step compiled for an H100
target with its traffic per mesh axis held against the planner's (within 5%)."""

from __future__ import annotations

import json

import jax
import pytest

from jaxpar import cli
from jaxpar.core import target
from jaxpar.planner.devices import load_device
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.model import Model
from jaxpar.planner.scaling import Point, point
from jaxpar.run.verify import check_scaling

MISSING = target.plugin_missing()


def _run(capsys, *extra):
    assert cli.main(["plan", "--model", "tiny", "--counts", "8,16,32", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_weak_scaling_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "weak.png"
    out = _run(capsys, "--scaling", "weak", "--family", "dp,zero3,3d", "--plot", str(plot))
    assert plot.stat().st_size > 0 and set(out["families"]) == {"dp", "zero3", "3d"}
    for rows in out["families"].values():
        assert [r["devices"] for r in rows] == [8, 16, 32] and [r["batch_size"] for r in rows] == [8, 16, 32]
        assert rows[0]["efficiency"] == 1.0
        for r in rows:
            assert r["efficiency"] == pytest.approx(rows[0]["step_time"] / r["step_time"])
            assert 0 <= r["comm_share"] < 1
    # the rows are the planner's own estimates of those layouts, on the H100 node of 8
    dp16 = out["families"]["dp"][1]
    est = estimate(Model.named("tiny"), Layout(data=16), Workload(16, out["seq_len"]), load_device("h100"))
    assert dp16["step_time"] == pytest.approx(est.step_time) and dp16["layout"] == est.layout.label(precision=False)
    # past one node the data all-reduce leaves NVLink for the NIC: the step grows
    assert dp16["step_time"] > out["families"]["dp"][0]["step_time"]


def test_strong_scaling_keeps_the_batch(capsys):
    rows = _run(capsys, "--scaling", "strong", "--family", "zero3")["families"]["zero3"]
    assert [r["batch_size"] for r in rows] == [32, 32, 32]
    assert rows[2]["efficiency"] == pytest.approx(rows[0]["step_time"] * 8 / (rows[2]["step_time"] * 32))


def test_a_family_that_cannot_split_says_why():
    p = point(Model.named("tiny"), "3d", 6, Workload(6, 64), load_device("h100"), "bf16")
    assert p.reason == "3d is tensor=2 x pipe=2 x data: 6 devices do not divide by 4"


def test_a_stand_in_that_cannot_run_is_reported_not_compiled():
    """--target compiles each whole-host count at one sequence per device; a layout that accumulates gradients
    cannot run that, and says so in its row (nothing is compiled)."""
    h100, work = load_device("h100"), Workload(64, 64)
    p = Point("best", 8, work, estimate(Model.named("tiny"), Layout(data=8, grad_accum=2), work, h100))
    [check] = check_scaling("tiny", [(p, "h100x8")], "h100x8", h100)
    assert "grad_accum x microbatches = 16" in check.reason and check.ratios() == {}
    assert "not compiled" in check.line()


@pytest.mark.parametrize("argv,message", [
    (["--scaling", "weak", "--family", "4d"], "--family: unknown 4d"),
    (["--scaling", "weak", "--explain", "data=8"], "--explain do not apply"),
    (["--family", "dp"], "--family / --counts / --plot go with --scaling"),
])
def test_bad_scaling_options_are_one_line(argv, message, capsys):
    assert cli.main(["plan", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.skipif(MISSING is not None or jax.config.jax_platforms != "cpu",
                    reason=MISSING or "the CUDA plugin is installed but JAX_PLATFORMS is not cpu")
def test_two_hosts_compiled_traffic_is_the_planners(capsys):
    """The 3D family (tensor, pipe, data) on two H100 hosts: each axis's compiled traffic within 5% of the
    planner's (the pipeline's double-buffered tick loop counted per tick)."""
    out = _run(capsys, "--scaling", "weak", "--family", "3d", "--counts", "16", "--target", "h100x8")
    [check] = out["compiled"]
    assert check["target"] == "2xh100x8" and check["layout"].startswith("data=4,pipe=2,tensor=2")
    assert set(check["ratios"]) >= {"data", "tensor", "pipe"}
    for axis, ratio in check["ratios"].items():
        assert abs(ratio - 1) <= 0.05, f"{axis}: planner / compiled = {ratio:.3f}"

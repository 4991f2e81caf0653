"""Steps compiled for NVIDIA hosts on this CPU machine (jaxpar.core.target: XLA's deviceless compilation).

The compiled cells need JAX's CUDA plugin (`pip install "jaxpar[gpu-target]"`) and cuDNN
(`pip install --no-deps nvidia-cudnn-cu12`) and skip, saying so, without them; each cell is compiled once
(`compiled`) and read by several tests. What does not compile (the refusals, the device facts of a CPU plan)
runs everywhere.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jaxpar import cli
from jaxpar.core import compile_cache, device_facts, target
from jaxpar.core.plan import Plan
from jaxpar.parallel import attention_flash, bits, offload
from jaxpar.planner import compare
from jaxpar.planner.devices import DEVICES, for_facts
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.mfu import for_flops
from jaxpar.planner.model import Model

MISSING = target.plugin_missing()
needs_plugin = pytest.mark.skipif(MISSING is not None or jax.config.jax_platforms != "cpu",
                                  reason=MISSING or "the CUDA plugin is installed but JAX_PLATFORMS is not cpu: without "
                                                    "it the plugin tries to open a GPU (set JAX_PLATFORMS=cpu)")
TINY = {"seq_len": 32}
WORK = Workload(batch_size=16, seq_len=32)
# (target, mesh, plan options, model): the layouts whose cuDNN attention crashed XLA's partitioner (tensor in the
# annotation form, the default 3D layout, experts and tensor left to the partitioner: there jax 0.12 also aborted
# on the embedding gather before the vocab-parallel lookup), and HSDP across two hosts with jaxpar's own Pallas
# kernel through Triton (in fp32; heads of 16: it takes no smaller). A fifth entry: the model's overrides.
CELLS = {
    "tensor": ("h100x8", "data=4,tensor=2", {"zero": 1, "precision": "bf16"}, "tiny"),
    "3d": ("h100x8", "data=2,tensor=2,pipe=2", {"zero": 1, "precision": "bf16", "microbatches": 4}, "tiny"),
    "experts": ("h100x8", "data=2,expert=2,tensor=2", {"precision": "bf16", "zero": 3}, "moe-tiny"),
    "hosts": ("2xh100x8", "replica=2,data=8", {"zero": 2, "attention": "pallas"}, "tiny", {"head_dim": 16}),
    # more of the CPU matrix's strategies (the whole matrix: benchmarks/gpu_matrix.py)
    "zero3": ("h100x8", "data=8", {"zero": 3, "precision": "bf16"}, "tiny"),
    "explicit": ("h100x8", "data=2,tensor=4", {"tensor_form": "explicit", "precision": "bf16"}, "tiny"),
    "1f1b": ("h100x8", "data=2,pipe=4", {"schedule": "1f1b", "microbatches": 8, "precision": "bf16"}, "tiny"),
    "ring": ("h100x8", "data=2,context=4", {"context_form": "ring", "precision": "bf16"}, "tiny"),
}
_REPORTS: dict[str, dict] = {}
_CACHE_REQUESTS: dict[str, int] = {}  # cell -> compiles of its inspection that went to the persistent cache
_REQUESTS = [0]  # this process's compiles that asked JAX's persistent cache (the directory is shared by workers)
jax.monitoring.register_event_listener(
    lambda event, **_: _REQUESTS.__setitem__(0, _REQUESTS[0] + (event == "/jax/compilation_cache/compile_requests_use_cache")))


def compiled(cell: str) -> dict:
    """`jaxpar inspect --json` of one cell compiled for its target (once per test process)."""
    if cell not in _REPORTS:
        from jaxpar.run.report import inspection
        from jaxpar.run.training import TrainConfig, prepare

        name, mesh, options, model, *overrides = CELLS[cell]
        plan = Plan.create(mesh, target=name, **options)
        config = TrainConfig(model=model, batch_size=WORK.batch_size, seq_len=WORK.seq_len,
                             model_overrides=overrides[0] if overrides else {})
        run = prepare(config, plan)
        before = _REQUESTS[0]
        _REPORTS[cell] = inspection(run)
        _CACHE_REQUESTS[cell] = _REQUESTS[0] - before
    return _REPORTS[cell]


def predicted(cell: str):
    name, mesh, options, model, *overrides = CELLS[cell]
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    layout = Layout(**sizes, **{"precision": "fp32", **{k: v for k, v in options.items() if k != "attention"}})
    model = Model.named(model, {**TINY, **(overrides[0] if overrides else {})})
    return estimate(model, layout, WORK, for_facts(target.parse(name).facts()))


# -- compiled for H100 hosts -------------------------------------------------------------------------------------

@needs_plugin
@pytest.mark.parametrize("cell", ["tensor", "3d", "experts"])
def test_cudnn_attention_compiles_where_the_partitioner_crashed(cell):
    report = compiled(cell)
    assert report["target"] == CELLS[cell][0] and report["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert [a.split(" ")[0] for a in report["attention"]] == ["cudnn"], report["attention"]
    assert report["memory"]["total"] > 0 and report["flops"] > 0


@needs_plugin
def test_a_target_compile_leaves_the_compile_cache_alone():
    """No process without the target's GPUs can load its executable (JAX warned at every later compile of the same
    step that it cannot read the entry): no compile of it reads or writes the cache, and the cache is on again
    after."""
    before = compile_cache.directory()
    compiled("tensor")
    assert _CACHE_REQUESTS["tensor"] == 0
    assert compile_cache.directory() == before


@needs_plugin
@pytest.mark.parametrize("cell", ["tensor", "hosts", "zero3", "explicit", "1f1b", "ring", "experts"])
def test_arguments_and_traffic_match_the_planner(cell):
    """The compiled step's argument bytes and traffic per mesh axis against the planner on the target's device,
    at the CPU grid's tolerance (10%), its collectives crossing every split axis; the two-host HSDP step's replica
    all-reduce crosses the hosts."""
    report = compiled(cell)
    split = {axis for axis, size in report["mesh"].items() if size > 1}
    assert split <= {axis for op in report["collectives"] for axis in op["axes"]}, report["collectives"]
    est = predicted(cell)
    assert not est.reason, est.reason
    ratios = compare.ratios(est, report)
    for key in ("arguments", *(k for k in ratios if k.startswith("traffic_") and k != "traffic_other")):
        assert abs(ratios[key] - 1) <= 0.10, f"{cell} {key}: prediction / compiled = {ratios[key]:.3f}"
    if cell == "hosts":
        assert report["process_axes"] == ["replica"]
        assert any(r["axes"] == ["replica"] and r["kind"] == "all-reduce" for r in report["collectives"])


@needs_plugin
def test_the_pallas_kernel_lowers_through_triton():
    report = compiled("hosts")
    assert [a.split(" ")[0] for a in report["attention"]] == ["pallas"]


@needs_plugin
def test_flops_of_a_target_compile_are_its_matmuls_and_attention():
    """No cost analysis on a deviceless compile: the figure is the module's matmuls and cuDNN calls, by trip count,
    within 10% of the planner's hardware FLOPs per device (no recomputation: remat none)."""
    report, est = compiled("tensor"), predicted("tensor")
    assert report["flops"] >= report["matmul_flops"] > 0
    assert report["flops"] == pytest.approx(est.hardware_flops, rel=0.10)


@needs_plugin
def test_the_gpu_profile_goes_in_as_compile_options():
    flags = compiled("tensor")["gpu_flags"]
    assert "xla_gpu_enable_latency_hiding_scheduler" in flags["applied"]
    assert "xla_gpu_enable_cub_radix_sort" in flags["applied"]  # no device to size its scratch space on
    assert set(flags["applied"]).isdisjoint(flags["not_compile_options"])


@needs_plugin
def test_a_target_plan_takes_the_gpu_paths():
    """Every backend choice reads the plan's devices: under an H100 target's plan, flash attention's GPU blocks,
    no XLA:CPU widening of 16-bit collectives, the H100's MFU peak. Offload is refused: JAX gives a compile-only
    device no memory spaces (a host sharding on it names none), so the step would not offload."""
    plan = Plan.create("data=8", target="h100x8", precision="bf16", zero=1)
    facts = device_facts.of_mesh(plan.mesh)
    assert (facts.backend, facts.hosts, facts.devices, facts.memory) == ("gpu", 1, 8, 84942979072)
    assert offload.on_host(plan.sharding(jax.sharding.PartitionSpec())).memory_kind is None
    with pytest.raises(ValueError, match="offload='optimizer' cannot be compiled for target 'h100x8'"):
        Plan.create("data=8", target="h100x8", precision="bf16", offload="optimizer", zero=1)
    with plan.activate():
        assert attention_flash.default_blocks() == attention_flash.BACKEND_BLOCKS["gpu"]
        assert not bits._widened(jax.ShapeDtypeStruct((4,), jnp.bfloat16))  # the target's devices run nothing
    assert for_flops(1e15, "bf16", list(plan.mesh.devices.flat)).peak == 8 * 989e12
    assert dataclasses.replace(for_facts(facts), hbm=DEVICES["h100"].hbm) == DEVICES["h100"]
    two = device_facts.of_mesh(Plan.create("data=16", target="2xh100x8").mesh)
    assert (two.hosts, two.devices) == (2, 16)


# -- refusals and the CPU's own facts (no plugin needed) ---------------------------------------------------------

def test_a_cpu_plan_keeps_the_cpu_paths():
    plan = Plan.create("data=8")
    facts = device_facts.of_mesh(plan.mesh)
    assert facts.backend == "cpu" and not facts.target
    with plan.activate():
        assert attention_flash.default_blocks() == attention_flash.BACKEND_BLOCKS["cpu"]
        assert bits._widened(jax.ShapeDtypeStruct((4,), jnp.bfloat16))


@pytest.mark.parametrize("name,message", [
    ("x100x8", "unknown target 'x100x8'"),
    ("no/such/file.txtpb", "no target config file"),
])
def test_a_bad_target_is_one_line(name, message, capsys):
    assert cli.main(["inspect", "--target", name]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


def test_train_refuses_a_target(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[plan]\ntarget = "h100x8"\n')
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "use `jaxpar inspect --target h100x8`" in capsys.readouterr().err


def test_a_forced_cudnn_on_cpu_is_one_line_before_anything_compiles(capsys):
    assert cli.main(["train", "--attention", "cudnn", "--steps", "1"]) == 2
    captured = capsys.readouterr()
    assert "attention='cudnn' cannot run on this plan: the plan's devices are cpu" in captured.err
    assert "step" not in captured.out and "Traceback" not in captured.err


def test_plan_takes_the_cluster_from_a_target(capsys):
    command = ["plan", "--model", "tiny", "--target", "2xh100x8", "--top", "1", "--batch-size", "64", "--json"]
    assert cli.main(command) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 16 and out["device"]["name"] == "H100 SXM 80GB" and out["device"]["hbm"] == 84942979072


def test_verify_needs_a_target(capsys):
    assert cli.main(["plan", "--model", "tiny", "--verify"]) == 2
    assert "--verify compiles the top layouts for a GPU target: give --target" in capsys.readouterr().err

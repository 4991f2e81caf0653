"""Host offload of the optimizer state (ZeRO-Offload): the same training, the state in host memory between steps.

The CPU backend has a `pinned_host` memory space but counts it with the
device's in `memory_analysis`, so here the placement is read from the arrays
and from the compiled step's entry layout (memory space S(5) is host memory);
`benchmarks/offload.py` shows the device bytes saved on a GPU.
"""

import json
import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import TINY, batches, compile_and_train, copy_state, max_relative_error, single_device_plan
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.cli import main
from jaxpar.models.llama import Llama
from jaxpar.core.plan import Plan
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step
from jaxpar.core.usage import PlanOptionUnused

STEPS = 3
OPTIMIZER = optax.adamw(1e-3)


def memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def host_layouts(compiled) -> tuple[int, int]:
    """(parameters, results) of the compiled step that live in host memory (layout memory space S(5))."""
    header = next(line for line in compiled.as_text().splitlines() if line.startswith("HloModule"))
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", header)
    return layout.group(1).count("S(5)"), layout.group(2).count("S(5)")


@pytest.fixture(scope="module")
def data():
    return batches(batch_size=16, seq_len=TINY.seq_len)


def start(plan):
    return init_state(lambda: Llama(TINY, nnx.Rngs(0)), OPTIMIZER, plan)


@pytest.mark.parametrize("mesh, options", [
    ("data=8", {"zero": 1}),
    ("data=4,tensor=2", {"zero": 3}),
    ("data=2,tensor=2,pipe=2", {"zero": 1, "microbatches": 4}),
], ids=["zero1", "zero3-tensor2", "zero1-3d-1f1b"])
def test_offloaded_optimizer_state_trains_like_one_device_and_stays_in_host_memory(data, mesh, options):
    model, initial = start(single_device_plan())
    reference, ref_final, _ = compile_and_train(model, initial, OPTIMIZER, single_device_plan(), data, STEPS)
    plan = Plan.create(mesh, offload="optimizer", **options)
    losses, final, compiled = compile_and_train(model, initial, OPTIMIZER, plan, data, STEPS)

    assert np.max(np.abs(losses / reference - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    assert max_relative_error(final.opt_state, ref_final.opt_state) <= 1e-5
    placed = place_state(copy_state(initial), model, OPTIMIZER, plan)
    assert memory_kinds(placed.opt_state) == {"pinned_host"} and memory_kinds(placed.params) == {"device"}
    state_leaves = len(jax.tree.leaves(placed.opt_state))
    assert host_layouts(compiled) == (state_leaves, state_leaves)  # in host memory before and after the step


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offload_keeps_the_fp32_master_parameters_in_host_memory_and_changes_no_bit(data, precision):
    runs = {}
    for offload in ("none", "optimizer"):
        plan = Plan.create("data=8", zero=1, precision=precision, offload=offload)
        model, state = start(plan)
        step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
        losses = []
        for i in range(STEPS):
            state, metrics = step(state, data[i])
            losses.append(float(metrics["loss"]))
        runs[offload] = losses, state
    assert runs["optimizer"][0] == runs["none"][0]
    offloaded = runs["optimizer"][1]
    assert memory_kinds(offloaded.opt_state) == {"pinned_host"}
    # ZeRO-1 holds the 2-byte params on the device and their fp32 master in the (offloaded) optimizer state
    assert memory_kinds(offloaded.params) == {"device"} and memory_kinds(offloaded.opt_state.master) == {"pinned_host"}
    assert max_relative_error(jax.device_get(offloaded.params), jax.device_get(runs["none"][1].params)) == 0
    assert max_relative_error(jax.device_get(offloaded.opt_state.master),
                              jax.device_get(runs["none"][1].opt_state.master)) == 0


def test_offloaded_checkpoint_restores_onto_a_plan_with_or_without_offload(tmp_path, data):
    plan = Plan.create("data=8", zero=1, offload="optimizer")
    model, state = start(plan)
    step = make_train_step(model, lambda m, b: m(b), OPTIMIZER, plan)
    state, _ = step(state, data[0])
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(1, state, force=True)
    saved = jax.device_get(state.opt_state)
    with Checkpoints(tmp_path) as checkpoints:
        for target in (Plan.create("data=4,tensor=2", zero=1), plan):
            restored, _ = checkpoints.restore(model, OPTIMIZER, target)
            assert memory_kinds(restored.opt_state) == {"pinned_host" if target.offload == "optimizer" else "device"}
            assert max_relative_error(jax.device_get(restored.opt_state), saved) == 0


def test_offload_is_refused_or_warned_where_it_cannot_act():
    with pytest.raises(ValueError, match=r"offload must be one of \('none', 'optimizer'\), got 'params'"):
        Plan.create("data=8", offload="params")
    model, _ = start(single_device_plan())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_train_step(model, lambda m, b: m(b), optax.sgd(0.1), Plan.create("data=8", offload="optimizer"))
    assert any(issubclass(w.category, PlanOptionUnused) and "moves nothing" in str(w.message) for w in caught)


def test_cli_trains_and_evaluates_with_the_state_offloaded(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--mesh", "data=8", "--zero", "1", "--precision", "bf16", "--offload", "optimizer",
                 "--steps", "2", "--eval-every", "2", "--batch-size", "8", "--seq-len", "16",
                 "--metrics", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert any("eval_loss" in row for row in rows)  # evaluation reads the host-resident parameters

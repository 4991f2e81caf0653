"""HSDP: ZeRO within `data`, plain data parallelism over `replica`; trains like one device, with only a shard crossing hosts.

On replica=2 x data=4 each ZeRO stage must match single-device training, and
its compiled step must keep every gather and reduce-scatter within `data`
(the bytes of `tests/test_zero.py`'s formula on four ranks) while the only
collective over `replica` is one all-reduce of the gradient shard (Ψ/4).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import (batches, compile_and_train, copy_state, gradients, max_relative_error, sharded_lookup_bytes,
                     single_device_plan)
from jaxpar.planner import inspect
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.core.plan import Plan
from jaxpar.train.state import init_state, place_state, state_specs

CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16)
STEPS = 4
HSDP = "replica=2,data=4"


@pytest.fixture(scope="module")
def reference():
    optimizer = optax.adamw(3e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan())
    data = batches(batch_size=16, seq_len=CONFIG.seq_len)
    losses, final, _ = compile_and_train(model, state, optimizer, single_device_plan(), data, STEPS)
    grads = gradients(model, state.params, data[0], single_device_plan())[1]
    return model, state, optimizer, data, losses, final, grads


@pytest.fixture(scope="module")
def runs(reference):
    """Each case's (plan, losses, final state, compiled step), compiled once for the tests that read them."""
    model, state, optimizer, data, *_ = reference
    cache = {}

    def run(zero, zero_axes=("data",)):
        if (zero, zero_axes) not in cache:
            plan = Plan.create(HSDP, zero=zero, zero_axes=zero_axes)
            cache[zero, zero_axes] = (plan, *compile_and_train(model, state, optimizer, plan, data, STEPS))
        return cache[zero, zero_axes]

    return run


def rows(compiled, plan) -> dict:
    """{(kind, axes): row} of the compiled step's collectives."""
    return {(r["kind"], tuple(r["axes"])): r for r in inspect.collectives(compiled, plan.mesh)}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_matches_single_device_with_a_shard_all_reduced_over_replica(reference, runs, zero):
    model, state, _, data, ref_losses, ref_final, ref_grads = reference
    plan, losses, final, compiled = runs(zero)
    assert plan.zero_axes == ("data",) and plan.rank_axes == ("replica", "data")
    loss_error = np.max(np.abs(losses / ref_losses - 1))
    param_error = max_relative_error(final.params, ref_final.params)
    grad_error = max_relative_error(gradients(model, state.params, data[0], plan)[1], ref_grads)
    print(f"zero={zero}: loss {loss_error:.1e}, params {param_error:.1e}, gradients {grad_error:.1e}")
    assert loss_error <= 1e-5 and param_error <= 1e-5 and grad_error <= 1e-5
    assert ref_losses[-1] < ref_losses[0]

    # Ψ: the parameter bytes (all whole before ZeRO on this mesh); the layers' share is gathered
    # again for ZeRO-3's backward pass. Every array of this model shards over data=4.
    psi = model.param_bytes()
    layers = sum(leaf.nbytes for leaf in jax.tree.leaves(model.logical) if leaf.names[0] == "layers")
    found = rows(compiled, plan)
    assert plan.zero_report(model.logical).replicated == ()
    # ZeRO-2/3 look the tokens up in each rank's rows of the table: a data group holds half the batch's rows
    lookup = sharded_lookup_bytes(CONFIG, 16 // plan.shape["replica"]) if zero >= 2 else dict.fromkeys(
        ("table", "tokens", "rows"), 0)
    assert found["reduce-scatter", ("data",)]["bytes"] == psi - lookup["table"] + lookup["rows"]
    assert found["all-gather", ("data",)]["bytes"] == (
        (psi + layers if zero == 3 else psi) - lookup["table"] + lookup["tokens"] + lookup["rows"])
    shard = found["all-reduce", ("replica",)]
    assert shard["count"] == 1 and shard["bytes"] == psi // plan.shape["data"]
    assert shard["traffic"] == psi / plan.shape["data"]  # a ring all-reduce over 2 sends 2(2-1)/2 = 1 x the shard
    # No gather or reduce-scatter touches replica; the other all-reduces carry scalars (loss, gradient norm).
    assert {kind for kind, axes in found if "replica" in axes and found[kind, axes]["bytes"] >= 64} == {"all-reduce"}
    assert {axes for _, axes in found} == {("data",), ("replica",), ("replica", "data")}
    assert all(r["bytes"] < 64 for (kind, axes), r in found.items() if kind == "all-reduce" and axes != ("replica",))


def test_zero_over_replica_and_data_shards_across_hosts_too(reference, runs):
    """zero_axes=("replica", "data"): plain ZeRO-3 over all eight ranks, nothing all-reduced but scalars."""
    model, state, _, _, ref_losses, ref_final, _ = reference
    plan, losses, final, compiled = runs(3, ("replica", "data"))
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    psi = model.param_bytes()
    found = rows(compiled, plan)
    lookup = sharded_lookup_bytes(CONFIG, 16)  # the lookup's group is all eight ranks, the whole batch
    assert found["reduce-scatter", ("replica", "data")]["bytes"] == psi - lookup["table"] + lookup["rows"]
    assert all(r["bytes"] < 64 for (kind, _), r in found.items() if kind == "all-reduce")
    assert not any(axes == ("data",) or axes == ("replica",) for kind, axes in found if kind != "all-reduce")


@pytest.mark.parametrize("zero_axes, message", [
    (("tensor",), "zero_axes names 'tensor', which is not a batch axis"),
    (("model",), "zero_axes names 'model', which is not a mesh axis; ZeRO shards over replica and/or data"),
    (("expert",), "ZeRO shards over replica and/or data, not expert"),
    ((), "zero_axes must name replica and/or data once each"),
    (("data", "data"), "zero_axes must name replica and/or data once each"),
])
def test_bad_zero_axes_fail_before_compiling(zero_axes, message):
    with pytest.raises(ValueError, match=message):
        Plan.create(HSDP, zero=3, zero_axes=zero_axes)


def test_zero_axes_from_text_and_the_preset():
    """The CLI and TOML give `replica,data` as text; the hsdp-2x4 preset is ZeRO-3 over data, replica across hosts."""
    assert Plan.create(HSDP, zero_axes="data, replica").zero_axes == ("replica", "data")
    preset = Plan.create("hsdp-2x4")
    assert (preset.shape["replica"], preset.shape["data"], preset.zero, preset.zero_axes) == (2, 4, 3, ("data",))
    with pytest.raises(ValueError, match="not a batch axis"):
        Plan.create(HSDP, zero=1, zero_axes="replica", rules={"batch": "data"})


def test_hsdp_checkpoint_restores_onto_data8_and_back(reference, runs, tmp_path):
    """A ZeRO-3 HSDP state saved, restored onto data=8 (ZeRO-3) and saved again, restored onto HSDP ZeRO-1: bitwise."""
    model, _, optimizer, *_ = reference
    plan, _, final, _ = runs(3)
    state = place_state(copy_state(final), model, optimizer, plan)
    source = tmp_path / "hsdp"
    with Checkpoints(source) as checkpoints:
        checkpoints.save(STEPS, state)
    host = copy_state(state)
    hops = [(source, Plan.create("data=8", zero=3)), (tmp_path / "data8", Plan.create(HSDP, zero=1))]
    for (directory, target), after in zip(hops, [tmp_path / "data8", None]):
        with Checkpoints(directory, read_only=True) as checkpoints:
            restored, meta = checkpoints.restore(model, optimizer, target)
        assert meta["step"] == STEPS
        expected = target.shardings(state_specs(model, optimizer, target))
        laid_out = jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim), restored, expected)
        assert all(jax.tree.leaves(laid_out)), f"restored arrays not in {target.shape}'s shardings"
        equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), restored, host)
        assert all(jax.tree.leaves(equal)), f"values restored onto {target.shape} differ from the saved ones"
        if after is not None:
            with Checkpoints(after) as checkpoints:
                checkpoints.save(STEPS, restored)

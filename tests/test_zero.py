"""ZeRO-1/2/3 over data train exactly like one device, with the collectives and memory each stage promises."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import batches, compile_and_train, max_relative_error, sharded_lookup_bytes, single_device_plan
from jaxpar.planner import inspect
from jaxpar.core import zero_layout
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.core.plan import Plan
from jaxpar.train.state import LogicalArray, abstract_state, describe, init_state
from jaxpar.train.step import make_train_step

CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16)
STEPS = 10


@pytest.fixture(scope="module")
def reference():
    optimizer = optax.adamw(3e-3)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optimizer, single_device_plan())
    data = batches(batch_size=16, seq_len=CONFIG.seq_len)
    losses, final, _ = compile_and_train(model, state, optimizer, single_device_plan(), data, STEPS)
    return model, state, optimizer, data, losses, final


def rows_by_kind(compiled, plan, axes=("data",)):
    """{kind: row} of the collectives that run over exactly `axes`."""
    return {r["kind"]: r for r in inspect.collectives(compiled, plan.mesh) if tuple(r["axes"]) == axes}


def local_param_bytes(model, plan, only_layers=False) -> int:
    """Bytes of one device's parameters before ZeRO (whole over data, split by the other axes' rules)."""
    specs = Plan.create(plan.mesh, zero=0).param_specs(model.logical)
    leaves = jax.tree.leaves(model.logical, is_leaf=lambda x: isinstance(x, LogicalArray))
    total = 0
    for leaf, spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        ways = np.prod([plan.shape[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e)], dtype=int)
        if leaf.names[0] == "layers" or not only_layers:
            total += np.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // ways
    return int(total)


@pytest.mark.parametrize(
    "mesh, options",
    [
        ("data=8", {"zero": 1}),
        ("data=8", {"zero": 2}),
        ("data=8", {"zero": 3}),
        ("data=4,tensor=2", {"zero": 3}),
        ("data=8", {"zero": 1, "grad_accum": 2}),
        ("data=8", {"zero": 2, "grad_accum": 2}),
    ],
    ids=["zero1", "zero2", "zero3", "zero3-tensor2", "zero1-accum2", "zero2-accum2"],
)
def test_zero_matches_single_device_with_its_collectives(reference, mesh, options):
    model, state, optimizer, data, ref_losses, ref_final = reference
    plan = Plan.create(mesh, **options)
    losses, final, compiled = compile_and_train(model, state, optimizer, plan, data, STEPS)

    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-5
    assert max_relative_error(final.params, ref_final.params) <= 1e-5
    assert ref_losses[-1] < ref_losses[0]

    # Gradients are reduce-scattered into the shards, never all-reduced whole,
    # and the parameters all-gathered: ZeRO-1 once per step; ZeRO-2/3 (whose
    # parameters stay sharded between steps) the layers once per microbatch,
    # ZeRO-3 again for the backward pass; the other parameters' gathers do not
    # depend on the microbatch and XLA hoists them out of the loop. The
    # all-reduces left over data carry scalars only (loss, norms).
    # ZeRO-2/3 look the tokens up in each rank's rows of the table (when no other axis splits it and that moves
    # fewer bytes) and trade its gather and reduce-scatter for the tokens' and the rows' (`sharded_lookup_bytes`).
    stage, k = plan.zero, plan.grad_accum
    psi, layers = local_param_bytes(model, plan), local_param_bytes(model, plan, only_layers=True)
    rows = rows_by_kind(compiled, plan)
    assert set(rows) == {"reduce-scatter", "all-gather", "all-reduce"}
    assert rows["all-reduce"]["bytes"] < 64
    lookup = {"table": 0, "tokens": 0, "rows": 0}
    if stage >= 2 and plan.shape["tensor"] == 1:
        lookup = sharded_lookup_bytes(CONFIG, 16, k)
        # The two sides of the size rule: one run's 256 tokens move more than the table (the table is gathered),
        # each accumulation run's 128 fewer (the lookup in the shards).
        assert (lookup["table"] == 0) == (k == 1)
    assert rows["reduce-scatter"]["bytes"] == ((psi - lookup["table"]) * k + lookup["rows"] if stage >= 2 else psi)
    gathers = {1: psi, 2: psi + (k - 1) * layers, 3: psi + (2 * k - 1) * layers}[stage]
    assert rows["all-gather"]["bytes"] == gathers - lookup["table"] + lookup["tokens"] + lookup["rows"]
    if stage >= 2:
        # Layers are gathered inside the layer scan (a loop body run once per
        # layer): the forward scan, and under ZeRO-3 the backward scan too.
        ops = inspect.collective_ops(compiled, plan.mesh)
        layer_loops = {op.computation for op in ops
                       if op.kind == "all-gather" and op.axes == ("data",) and op.count == CONFIG.n_layers * k}
        assert len(layer_loops) == stage - 1


def test_zero3_gathers_layers_just_in_time():
    """A deep ZeRO-3 model never holds every layer's full parameters: peak temp stays well below them.

    SGD keeps the optimizer out of the picture; ZeRO-2 on the same model, which
    keeps every layer's gathered parameters for the backward pass, shows that
    the measure can fail.
    """
    cfg = LlamaConfig(vocab=256, d_model=64, n_layers=16, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=512, seq_len=4)
    model = describe(lambda: Llama(cfg, nnx.Rngs(0)))
    optimizer = optax.sgd(1e-2)
    temp = {}
    for stage in (2, 3):
        plan = Plan.create("data=8", zero=stage)
        batch = {k: jax.ShapeDtypeStruct((8, cfg.seq_len), np.int32, sharding=plan.sharding(plan.batch_spec(2)))
                 for k in ("inputs", "targets")}
        step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
        temp[stage] = inspect.memory(step.lower(abstract_state(model, optimizer, plan), batch).compile())["temp"]
    assert temp[3] < 0.5 * model.param_bytes()
    assert temp[2] > model.param_bytes()


def test_zero3_under_bf16_gathers_bf16_casts_of_fp32_shards():
    """bf16 holds fp32 parameters; each ZeRO-3 gather moves the 2-byte cast, and the stacked layers' one layer at a time.

    Read from the step as jaxpar emits it, where the bf16 casts travel as their uint16 bits (jaxpar.parallel.bits), and
    from the compiled step, where those gathers stay 16-bit (XLA's CPU backend widens bf16 ones to fp32).
    """
    model = describe(lambda: Llama(CONFIG, nnx.Rngs(0)))
    optimizer = optax.adamw(1e-3)
    gathers, compiled = {}, {}
    for name in ("fp32", "bf16"):
        plan = Plan.create("data=8", zero=3, precision=name)
        state = abstract_state(model, optimizer, plan)
        assert {a.dtype for a in jax.tree.leaves(state.params)} == {np.dtype(np.float32)}
        batch = {k: jax.ShapeDtypeStruct((16, CONFIG.seq_len), np.int32, sharding=plan.sharding(plan.batch_spec(2)))
                 for k in ("inputs", "targets")}
        lowered = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(state, batch)
        gathers[name] = [line.split("->")[-1] for line in lowered.as_text().splitlines() if "all_gather" in line
                         and "xi32>" not in line.split("->")[-1]]  # the embedding lookup's token gather
        compiled[name] = {line.split("=")[1].split()[0] for line in lowered.compile().as_text().splitlines()
                          if " all-gather(" in line and "s32[" not in line}
    assert gathers["fp32"] and all("xf32>" in g for g in gathers["fp32"])
    assert len(gathers["bf16"]) == len(gathers["fp32"]) and all("xui16>" in g for g in gathers["bf16"]), gathers["bf16"]
    assert not any(g.startswith(f" tensor<{CONFIG.n_layers}x") for g in gathers["bf16"])  # no whole-stack gather
    assert compiled["fp32"] and all(shape.startswith("f32[") for shape in compiled["fp32"])
    assert compiled["bf16"] and all(shape.startswith("u16[") for shape in compiled["bf16"])


def test_zero_shards_a_free_dimension_never_tensor_or_layers():
    model = describe(lambda: Llama(CONFIG, nnx.Rngs(0)))
    specs = Plan.create("data=4,tensor=2", zero=3).param_specs(model.logical)
    blocks = specs["blocks"]
    assert blocks["wq"] == jax.sharding.PartitionSpec(None, "data", "tensor")  # [layers, embed, heads, head_dim]
    assert blocks["w_down"] == jax.sharding.PartitionSpec(None, "tensor", "data")  # [layers, mlp, embed]
    assert blocks["attn_norm"] == jax.sharding.PartitionSpec(None, "data")  # never the layers axis
    assert specs["embedding"] == jax.sharding.PartitionSpec("tensor", "data")
    assert Plan.create("data=4,tensor=2", zero=1).param_specs(model.logical) == \
        Plan.create("data=4,tensor=2", zero=0).param_specs(model.logical)


def test_replicated_parameters_are_reported_and_bounded():
    logical = {
        "big": LogicalArray((64, 48), np.float32, ("embed", "mlp")),
        "odd": LogicalArray((7, 5), np.float32, ("embed", None)),
        "layer_scalars": LogicalArray((8,), np.float32, ("layers",)),
    }
    report = Plan.create("data=8", zero=1).zero_report(logical)
    assert [path for path, _, _ in report.replicated] == ["['layer_scalars']", "['odd']"]
    assert report.fraction == pytest.approx((7 * 5 + 8) / (64 * 48 + 7 * 5 + 8))
    assert "no unsharded dimension divides by data=8" in str(report)
    with pytest.raises(ValueError, match=r"(?s)\['odd'\] \(7, 5\).*above zero_tolerance=1\.00%"):
        Plan.create("data=8", zero=2, zero_tolerance=0.01).optimizer_specs(optax.sgd(0.1), logical)
    specs = Plan.create("data=8", zero=2, zero_tolerance=0.05).optimizer_specs(optax.sgd(0.1), logical)
    assert specs is not None
    assert Plan.create("data=1", devices=jax.devices()[:1], zero=3).zero_report(logical).fraction == 0.0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"zero": 4}, "zero stage must be 0, 1, 2 or 3, got 4"),
        ({"remat": "some"}, "remat policy must be one of"),
        ({"zero_tolerance": 1.5}, "zero_tolerance must be a fraction in"),
    ],
)
def test_bad_zero_options_fail_clearly(options, message):
    with pytest.raises(ValueError, match=message):
        Plan.create("data=8", **options)


def test_zero_on_a_single_data_rank_says_it_changes_nothing():
    lone = Plan.create("tensor=8", zero=2)
    assert "zero=2 has no effect: the data axis has size 1" in zero_layout.no_effect_message(lone)
    assert zero_layout.no_effect_message(Plan.create("data=8", zero=2)) is None
    assert zero_layout.no_effect_message(Plan.create("tensor=8")) is None

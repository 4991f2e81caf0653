"""What a step that accumulates microbatches under ZeRO-3 holds, and what the planner says when no layout fits with
an fp32 master.

Compiled for an H100 host (deviceless, JAX's CUDA plugin): the optax update writes the donated parameters and
moments in place, and the layer scan sums each microbatch's gradients of the stack into the fp32 accumulators
in its backward carry (`jaxpar.parallel.grad_sink`), so no microbatch gradient of the stack lies beside them
(before: one more fp32 shard, the transpose of the cast at use); the planner counts it so
(`jaxpar.planner.memory.update_workspace`). The sums' values are held by tests/test_grad_accum.py and
tests/test_zero.py against one device. Runtime: ~30 s with the plugin (one compile), ~6 s without.
"""

from __future__ import annotations

import math

import jax
import pytest

from jaxpar.core import target
from jaxpar.core.plan import Plan
from jaxpar.planner.devices import for_facts
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.memory import inventory
from jaxpar.planner.model import Model
from jaxpar.planner.search import default_batch, explain_choice, plan

MISSING = target.plugin_missing()
needs_plugin = pytest.mark.skipif(MISSING is not None or jax.config.jax_platforms != "cpu",
                                  reason=MISSING or "the CUDA plugin is installed but JAX_PLATFORMS is not cpu")
# a model whose parameters outweigh its activations at this batch, so the gradient buffers decide the temp
WIDE = {"seq_len": 32, "d_model": 512, "d_ff": 2048, "n_layers": 8, "vocab": 256, "n_heads": 8, "n_kv_heads": 8,
        "head_dim": 64}
OPTIONS = {"zero": 3, "precision": "bf16", "grad_accum": 2, "remat": "full"}
WORK = Workload(batch_size=16, seq_len=32)


@needs_plugin
def test_accumulating_under_zero3_updates_in_place_and_peaks_in_the_loop():
    from jaxpar.run.report import inspection
    from jaxpar.run.training import TrainConfig, prepare

    run = prepare(TrainConfig(model="tiny", batch_size=WORK.batch_size, seq_len=WORK.seq_len, model_overrides=WIDE),
                  Plan.create("data=8", target="h100x8", **OPTIONS))
    compiled = inspection(run)["memory"]
    model = Model.named("tiny", WIDE)
    est = estimate(model, Layout(data=8, **OPTIONS), WORK, for_facts(target.parse("h100x8").facts()))
    shard = est.memory["params"] / 4  # fp32 parameters per device, ZeRO-3's shard
    stacked = inventory(model, 8, 1, 1, 1, "trained").stacked_sharded
    state = est.memory["params"] + est.memory["optimizer"]  # the fp32 shard and Adam's two moments
    assert compiled["alias"] >= state, compiled  # every state buffer donated and written in place by the update
    # the fp32 accumulators, and no microbatch gradient of the stack beside them (53.8 MB before: 27.7 now)
    assert 4 * shard <= compiled["temp"] < 4 * shard + 4 * stacked, (compiled, shard, stacked)
    assert math.isclose(est.memory["total"], compiled["total"], rel_tol=0.10), (est.memory, compiled)

def test_no_layout_fitting_with_an_fp32_master_ranks_bf16_params_saying_why():
    """Mixtral 8x7B (46.7B) on 8 H100s at ~4M tokens: 16 bytes of fp32 state and accumulator per parameter over 8
    devices leave too little room; bf16 parameters and moments fit, named as such."""
    model = Model.named("mixtral-8x7b")
    ranking = plan(model, 8, Workload(default_batch(model, 8, 4096), 4096), "h100", precision="bf16")
    assert ranking.instead_of is not None and ranking.instead_of.best is None
    assert ranking.best.layout.precision == "bf16-params" and ranking.best.fits
    first = explain_choice(ranking)[0]
    assert first.startswith("no layout fits with precision=bf16 ") and "bf16-params" in first, first
    moe = Model.named("qwen3-30b-a3b")  # fits with its fp32 master since the sums moved into the layer scan
    fits = plan(moe, 8, Workload(default_batch(moe, 8, 4096), 4096), "h100", precision="bf16")
    assert fits.instead_of is None and fits.best.layout.precision == "bf16"

"""MoE models with dense layers among the MoE ones through the Hugging Face door, against real transformers:
Qwen3-MoE with `decoder_sparse_step` > 1 or `mlp_only_layers` (jaxpar's `moe_every` groups, and a dense prefix of
`first_dense` blocks before them: `mlp_only_layers=[0]`).

One small random float32 model per layout (module fixture, made by transformers and saved with
`save_pretrained`): logits both ways, the export's tensor names (strict reload) and config, greedy generation
token for token, and the imported config trained under a strategy equal to the plain-JAX reference.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import family_strategies
from jaxpar.interop import hf, hf_config, hf_write
from jaxpar.models.moe import MoeLlama
from test_hf import (TOKENS, assert_greedy_generation_equals_generate, needs_torch, relative, saved_family, torch,
                     torch_logits, transformers)
from test_hf_export import unchanged

IRREGULAR = {"decoder_sparse_step": 1, "mlp_only_layers": [1, 3], "num_hidden_layers": 6}
DENSE_THIRD = {"decoder_sparse_step": 1, "mlp_only_layers": [2]}
PREFIX_STEP_2 = {"decoder_sparse_step": 2, "mlp_only_layers": [0], "num_hidden_layers": 5}
FIELDS = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=True, moe_intermediate_size=24)
# layout -> the config fields that make layers 1 and 3 the MoE ones, 0 and 2 dense; a dense first layer; a
# dense first layer before groups of (dense, MoE) on 5 layers; a dense layer 2 of 4 (M M D M: no period);
# decoder_sparse_step=2 with a dense first layer on 5 (D M D M D: a prefix, then groups of (MoE, dense))
LAYOUTS = {"decoder_sparse_step": {"decoder_sparse_step": 2},
           "mlp_only_layers": {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]},
           "dense_prefix": {"decoder_sparse_step": 1, "mlp_only_layers": [0]},
           "prefix_and_groups": {"decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 3], "num_hidden_layers": 5},
           "no_period": DENSE_THIRD,
           "prefix_step_2_dense_last": PREFIX_STEP_2}
# layout -> jaxpar's (first_dense, moe_every, moe_pattern, its block stacks)
STACKS = {"decoder_sparse_step": (0, 2, "", ["dense", "moe"]), "mlp_only_layers": (0, 2, "", ["dense", "moe"]),
          "dense_prefix": (1, 1, "", ["moe", "prefix"]), "prefix_and_groups": (1, 2, "", ["dense", "moe", "prefix"]),
          "no_period": (0, 4, "MMDM", ["dense", "moe"]),
          "prefix_step_2_dense_last": (1, 2, "MD", ["dense", "moe", "prefix"])}


def qwen3_moe(layout: str, **fields):
    """A random float32 Qwen3-MoE of `layout` (with `fields` changed); norms perturbed (transformers starts them at 1)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**FIELDS, **LAYOUTS.get(layout, {}), **fields})
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=list(LAYOUTS))
def saved(request, tmp_path_factory):
    """(layout, transformers model, its save_pretrained directory)."""
    return saved_family(request.param, qwen3_moe, tmp_path_factory)


def jaxpar_model(cfg, params):
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoeLlama(cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, jax_tree(params))
    return nnx.merge(graphdef, state)


def random_model(cfg):
    """A jaxpar model of `cfg` with its own random weights (an export's source other than an import)."""
    with nnx.use_eager_sharding(False):
        return MoeLlama(cfg, nnx.Rngs(7))


def jax_tree(params):
    return {k: jax_tree(v) if isinstance(v, dict) else jnp.asarray(v) for k, v in params.items()}


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    """Import: logits within 1e-5 (the dense layers' MLPs in the prefix and dense stacks); the layout moves them.
    Export of a random jaxpar model: transformers reloads the files strictly (the dense layers' `mlp.gate_proj`, the
    MoE ones' experts) with its logits, and the config keeps the source's layout fields."""
    layout, reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.first_dense, cfg.moe_every, cfg.moe_pattern, sorted(params["blocks"])) == STACKS[layout]
    theirs = torch_logits(reference, TOKENS)
    imported_model = jaxpar_model(cfg, params)
    imported = relative(np.asarray(imported_model.logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
    loss = imported_model({"inputs": jnp.asarray(TOKENS[:, :-1]), "targets": jnp.asarray(TOKENS[:, 1:])})[0]
    with torch.no_grad():  # step 1's loss: the training forward against transformers' own (labels shifted inside)
        their_loss = float(reference(torch.tensor(TOKENS), labels=torch.tensor(TOKENS)).loss)
    loss_error = abs(float(loss) / their_loss - 1)
    assert loss_error <= 1e-5, loss_error
    every_layer = relative(torch_logits(qwen3_moe("every layer MoE", **{k: v for k, v in LAYOUTS[layout].items()
                                                                       if k == "num_hidden_layers"}), TOKENS), theirs)
    assert every_layer > 1e-3, every_layer

    source = json.loads((directory / "config.json").read_text())
    ours = random_model(cfg)
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out", source=source)
    model, info = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    back = relative(torch_logits(model.float().eval(), TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    assert unchanged(source, json.loads((tmp_path / "out" / "config.json").read_text())) == []
    print(f"{layout}: import {imported:.2e}, step-1 loss {loss_error:.2e}, export {back:.2e}, every layer MoE moves "
          f"them {every_layer:.2e}")


@needs_torch
@pytest.mark.parametrize("saved", [layout for layout in LAYOUTS if layout != "prefix_step_2_dense_last"],
                         indirect=True)  # its decode is prefix_and_groups' (a prefix, then places of a group)
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode over the groups (dense, then MoE block), or a pattern's runs one after another (the
    cache cut between them), token for token against `generate`."""
    _, reference, directory = saved
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(MoeLlama, reference, directory)


@pytest.mark.parametrize("fields, layout", [
    ({"mlp_only_layers": [0, 2]}, (0, 2, "", 2, [])),
    ({"mlp_only_layers": [0]}, (1, 1, "", 1, [0])),
    ({"mlp_only_layers": [0, 1, 3], "num_hidden_layers": 5}, (1, 2, "", 1, [0, 1, 3])),
    ({"mlp_only_layers": [0, 1, 2, 4], "num_hidden_layers": 6}, (2, 2, "", 2, [1])),
    ({"mlp_only_layers": [1]}, (0, 4, "MDMM", 1, [1])),  # no period: one group of 4
    ({"mlp_only_layers": [3]}, (0, 4, "MMMD", 1, [3])),  # a dense last layer
    (DENSE_THIRD, (0, 4, "MMDM", 1, [2])),
    ({"decoder_sparse_step": 3}, (2, 2, "MD", 3, [])),  # D D M D: a prefix, then (MoE, dense)
    (IRREGULAR, (0, 6, "MDMDMM", 1, [1, 3])),
    (PREFIX_STEP_2, (1, 2, "MD", 2, [])),
    ({"mlp_only_layers": [0, 3], "num_hidden_layers": 6}, (0, 3, "DMM", 1, [0, 3])),  # a period of 3
])
def test_a_written_config_names_the_layout_and_reads_back(fields, layout):
    """The import's (first_dense, moe_every, moe_pattern): the shortest group, then prefix, making the layers; without a
    source, the export's decoder_sparse_step (the largest step every MoE layer keeps) and the MLP-only layers that step
    does not make; read back, the same config, and transformers' own rule gives the same MoE layers."""
    from jaxpar.models import moe_layout

    hf = {**FIELDS, "model_type": "qwen3_moe", **fields}
    cfg = hf_config.config_from_hf(hf)
    written = hf_config.config_to_hf(cfg)
    assert (cfg.first_dense, cfg.moe_every, cfg.moe_pattern, written["decoder_sparse_step"],
            written["mlp_only_layers"]) == layout
    assert hf_config.config_from_hf(written) == cfg
    for config in (hf, written):  # Qwen3MoeDecoderLayer's test: not in mlp_only_layers, and (i + 1) % step == 0
        step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
        assert moe_layout.kinds(cfg) == "".join("M" if i not in dense and (i + 1) % step == 0 else "D"
                                                for i in range(config["num_hidden_layers"]))


@pytest.mark.parametrize("fields, message", [
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}, r"make layers \[\] of 4 MoE layers: a model without"),
    ({"decoder_sparse_step": 5}, r"decoder_sparse_step=5, mlp_only_layers=\[\] make layers \[\] of 4"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an int >= 1"),
    ({"num_experts": 0}, r"num_experts=0, decoder_sparse_step=1, mlp_only_layers=\[\] make layers \[\] of 4"),
])
def test_layouts_without_an_moe_layer_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf({**FIELDS, "model_type": "qwen3_moe", **fields})


@pytest.mark.parametrize("fields, message", [
    ({"first_dense": 1, "moe_every": 2}, "moe_every=2 must be >= 1 and divide n_layers=4 less first_dense=1"),
    ({"first_dense": 4}, r"first_dense=4 must be between 0 and n_layers - 1=3"),
    ({"first_dense": 1, "moe_every": 1, "sliding_window": 8, "sliding_pattern": 2},
     "first_dense=1 with sliding_pattern=2: dense"),
    ({"moe_every": 4, "moe_pattern": "MDM"}, r"moe_pattern='MDM' must be moe_every=4 blocks of D \(dense\) and M"),
    ({"moe_every": 2, "moe_pattern": "DD"}, "moe_pattern='DD' must be moe_every=2 blocks .* with at least one M"),
    ({"moe_every": 2, "moe_pattern": "Mx"}, "moe_pattern='Mx' must be"),
    ({"moe_every": 2, "moe_pattern": "MD", "sliding_window": 8, "sliding_pattern": 2},
     "moe_pattern='MD' with sliding_pattern=2: a pattern of dense and MoE blocks takes no local/global"),
])
def test_a_dense_prefix_that_cannot_be_built_is_refused_in_one_line(fields, message):
    from jaxpar.models.moe import MoeLlamaConfig

    with pytest.raises(ValueError, match=message):
        MoeLlamaConfig(n_layers=4, **fields)


def test_a_dense_prefix_is_written_only_as_a_qwen3_moe():
    """Mixtral's config has no dense layer: a prefix without q/k norms is refused by name, not dropped."""
    from jaxpar.models.moe import MoeLlamaConfig

    with pytest.raises(ValueError, match="moe_every=1, first_dense=1: a Hugging Face Mixtral has an MoE feed-forward"):
        hf_config.config_to_hf(MoeLlamaConfig(n_layers=4, moe_every=1, first_dense=1))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The imported prefix_and_groups config's plain-JAX reference run (`family_strategies.reference_run`): a dense
    first layer, then groups of a dense and an MoE layer (all three stacks)."""
    directory = saved_family("prefix_and_groups", qwen3_moe, tmp_path_factory)[2]
    cfg = hf_config.config_from_hf(json.loads((directory / "config.json").read_text()))
    return family_strategies.reference_run(lambda: MoeLlama(cfg, nnx.Rngs(1)), cfg)


@needs_torch
@pytest.mark.parametrize("mesh, options", [("data=4,expert=2", {}),
                                           ("data=4,pipe=2", {"microbatches": 2, "schedule": "1f1b"}),
                                           ("data=4,tensor=2", {"zero": 3})])
def test_training_the_imported_config_equals_one_device(reference_run, mesh, options):
    """3 SGD steps of the imported config (prefix, dense and MoE stacks; the prefix with the embedding under the
    pipeline) under a strategy against the plain-JAX reference."""
    family_strategies.assert_matches(reference_run, mesh, options, f"qwen3_moe mlp_only_layers=[0, 1, 3] {mesh}")


# -- dense layers anywhere (moe_pattern): every plan, without torch ---------------------------------------------

def pattern_config(fields: dict):
    """A layout's imported config (its config.json fields alone: no torch), with the routers' balance loss on so
    that every MoE layer's statistics count."""
    cfg = hf_config.config_from_hf({**FIELDS, "model_type": "qwen3_moe", **fields})
    return dataclasses.replace(cfg, load_balance_coef=1e-2)


@pytest.mark.parametrize("fields, moe_layers, pipeline_units", [
    (IRREGULAR, 4, 1), (DENSE_THIRD, 3, 1), (PREFIX_STEP_2, 2, 1),
    ({"mlp_only_layers": [0, 3], "num_hidden_layers": 6}, 4, 2),
])
def test_planner_counts_a_pattern_as_the_model_builds_it(fields, moe_layers, pipeline_units):
    """The planner's inventory (the dense and MoE stacks; on `prefix_layers` where they run apart), parameter count,
    MoE layers and what a pipeline may cut (nothing with a prefix or no period, else the groups) from the config."""
    from jaxpar.planner.model import Model, leaves_of, llama_leaves
    from jaxpar.train.state import describe

    cfg = pattern_config(fields)
    counted = llama_leaves(cfg)
    traced = leaves_of(describe(lambda: MoeLlama(cfg, nnx.Rngs(0))).logical)
    assert sorted((a.shape, a.names) for a in counted) == sorted((a.shape, a.names) for a in traced)
    assert sum(a.size for a in counted) == cfg.param_count()
    planned = Model.from_config("pattern", cfg, counted)
    assert (cfg.n_moe_layers, planned.moe_layers, planned.pipeline_units) == (moe_layers, moe_layers, pipeline_units)


@pytest.fixture(scope="module")
def no_period_run():
    """M M D M (mlp_only_layers=[2] of 4): one group, its runs (M M, D, M) scanned one after another; the plain-JAX
    reference's 3 SGD steps (`family_strategies.reference_run`)."""
    cfg = pattern_config(DENSE_THIRD)
    assert (cfg.first_dense, cfg.moe_every, cfg.moe_pattern) == (0, 4, "MMDM")
    return family_strategies.reference_run(lambda: MoeLlama(cfg, nnx.Rngs(1)), cfg)


def test_dense_layers_of_no_period_train_as_one_device(no_period_run):
    """3 SGD steps of the runs of M M D M (each scanned over its slice of the dense or MoE stack) on data=4,expert=2
    under ZeRO-3 against the plain-JAX reference (the tensor plan: the LoRA test's); the compiled step gathers the
    stacked weights over data a layer at a time (every gathered array of one layer's rank, never a run's stack)."""
    from helpers import copy_state, max_relative_error
    from jaxpar.core.plan import Plan
    from jaxpar.planner import inspect
    from jaxpar.train.state import place_state
    from jaxpar.train.step import make_train_step

    model, state, optimizer, batches, expected = no_period_run
    plan = Plan.create("data=4,expert=2", devices=jax.devices()[:8], zero=3)
    placed = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan).lower(placed, batches[0]).compile()
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    loss_error = np.max(np.abs(np.array(losses) / expected.losses - 1))
    param_error = max_relative_error(jax.device_get(placed.params), expected.params)
    assert loss_error <= 1e-5 and param_error <= 1e-5, (loss_error, param_error)
    assert expected.losses[-1] < expected.losses[0]
    gathers = [op for op in inspect.collective_ops(step, plan.mesh) if op.kind == "all-gather" and op.axes == ("data",)]
    # one layer's weights are of rank 3 at most (wq [d, heads, head_dim], the experts' [E, d, f]); a run's stack, 4
    assert gathers and max(len(shape) for op in gathers for shape in op.shapes) == 3, gathers
    print(f"qwen3_moe mlp_only_layers=[2] of 4 data=4,expert=2 zero 3: losses {loss_error:.1e}, parameters "
          f"{param_error:.1e}, {len(gathers)} all-gathers over data, each of one layer")


def test_a_pipeline_that_cannot_cut_equal_stages_is_refused_in_one_line(no_period_run):
    """No pipeline stage can hold the same layers as another: the plan is refused naming the layers and the stages,
    before anything compiles."""
    from helpers import copy_state
    from jaxpar.core.plan import Plan
    from jaxpar.train.state import place_state
    from jaxpar.train.step import make_train_step

    model, state, optimizer, batches, _ = no_period_run
    plan = Plan.create("data=4,pipe=2", devices=jax.devices()[:8], microbatches=2, schedule="1f1b")
    placed = place_state(copy_state(state), model, optimizer, plan)
    with pytest.raises(ValueError) as refused:
        make_train_step(model, lambda m, b: m(b), optimizer, plan)(placed, batches[0])
    assert str(refused.value) == (
        "MoE layers [0, 1, 3] and dense layers [2] of 4 do not split into pipe=2 x virtual_stages=1 = 2 pipeline "
        "stages of the same layers: the pattern 'MMDM' repeats 1 time(s), not a multiple of 2; use a plan without a "
        "pipeline (pipe=1)")


@pytest.fixture(scope="module")
def prefix_step_2_run():
    """D M D M D (decoder_sparse_step=2, mlp_only_layers=[0] of 5): a dense prefix, then two groups of (MoE, dense)."""
    cfg = pattern_config(PREFIX_STEP_2)
    assert (cfg.first_dense, cfg.moe_every, cfg.moe_pattern) == (1, 2, "MD")
    return family_strategies.reference_run(lambda: MoeLlama(cfg, nnx.Rngs(1)), cfg)


def test_a_period_after_a_prefix_trains_on_a_pipeline(prefix_step_2_run):
    """The groups of (MoE, dense) cut into 2 stages, the prefix with the embedding, the last layer dense: 3 SGD
    steps under GPipe equal to the plain-JAX reference (the imported prefix_and_groups config runs 1F1B above)."""
    family_strategies.assert_matches(prefix_step_2_run, "data=4,pipe=2", {"microbatches": 2, "schedule": "gpipe"},
                                     "qwen3_moe decoder_sparse_step=2 mlp_only_layers=[0] of 5 data=4,pipe=2 gpipe")


def test_lora_on_dense_layers_of_no_period_matches_the_plain_jax_reference():
    """LoRA adapters on q and the gates of M M D M (dense and MoE stacks, experts included) trained on the tensor plan
    data=4,tensor=2 under ZeRO-3 against the plain-JAX LoRA reference; the base never moves."""
    import optax

    import reference_lora
    from helpers import batches, copy_state, max_relative_error, single_device_plan
    from jaxpar.core.plan import Plan
    from jaxpar.parallel import lora
    from jaxpar.train.state import init_state, place_state
    from jaxpar.train.step import make_train_step

    cfg, optimizer, rank, alpha = pattern_config(DENSE_THIRD), optax.sgd(0.5, momentum=0.9), 4, 8.0

    def build():
        model = MoeLlama(cfg, nnx.Rngs(0))
        lora.apply(model, rank, alpha, targets=("q", "gate"), rngs=nnx.Rngs(1))  # gate: w_gate and expert_gate
        return model

    model, state = init_state(build, optimizer, single_device_plan(), trainable=lora.TRAINABLE)
    state = reference_lora.with_random_b(copy_state(state))
    data = [batches(batch_size=8, seq_len=16)[0]] * 2  # one batch twice: its loss must fall
    expected = reference_lora.train(cfg, state.params, data, optimizer, alpha / rank)
    plan = Plan.create("data=4,tensor=2", devices=jax.devices()[:8], zero=3, lora_rank=rank, lora_alpha=alpha)
    placed = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    losses = []
    for batch in data:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    adapters, frozen = reference_lora.split(jax.device_get(placed.params))
    loss_error = np.max(np.abs(np.array(losses) / expected.losses - 1))
    adapter_error = max_relative_error(adapters, expected.params)
    assert loss_error <= 1e-5 and adapter_error <= 1e-5, (loss_error, adapter_error)
    assert max_relative_error(frozen, reference_lora.split(state.params)[1]) == 0.0
    assert {"w_gate_lora_a", "wq_lora_a"} <= set(adapters["blocks"]["dense"])
    assert {"expert_gate_lora_a", "wq_lora_a"} <= set(adapters["blocks"]["moe"])
    assert expected.losses[-1] < expected.losses[0]
    print(f"LoRA mlp_only_layers=[2] of 4 data=4,tensor=2 zero 3: losses {loss_error:.1e}, adapters "
          f"{adapter_error:.1e}")


# -- Llama 4 with dense layers between the MoE ones (Maverick's interleave_moe_layer_step=2) --------------------

@pytest.fixture(scope="module")
def maverick(tmp_path_factory):
    """(transformers Llama 4 with interleave_moe_layer_step=2: layers 1 and 3 MoE, 0 and 2 dense of
    intermediate_size_mlp; its save_pretrained directory)."""
    import test_hf_llama4

    _, model, directory = saved_family("llama4", lambda _: test_hf_llama4.family_model(interleave_moe_layer_step=2),
                                       tmp_path_factory)
    return model, directory


@needs_torch
def test_llama4_dense_layers_match_transformers_both_ways(maverick, tmp_path):
    """Import: logits within 1e-5 (the dense layers' `feed_forward.gate_proj` of intermediate_size_mlp), moved by the
    layout; export of a random jaxpar model: strict reload with its logits and the source config's every field; greedy decode equal."""
    import test_hf_llama4

    reference, directory = maverick
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.moe_every, params["blocks"]["dense"]["w_gate"].shape) == (2, (2, 32, 48))
    theirs = torch_logits(reference, TOKENS)
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
    every_layer = relative(torch_logits(test_hf_llama4.family_model(), TOKENS), theirs)
    assert every_layer > 1e-3, every_layer

    source = json.loads((directory / "config.json").read_text())
    ours = random_model(cfg)
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out", source=source)
    back = relative(torch_logits(test_hf_llama4.reload(tmp_path / "out"), TOKENS),
                    np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    assert unchanged(source, json.loads((tmp_path / "out" / "config.json").read_text())) == []
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(MoeLlama, reference, directory)
    print(f"llama4 interleave_moe_layer_step=2: import {imported:.2e}, export {back:.2e}, every layer MoE moves "
          f"them {every_layer:.2e}")


def test_llama4_config_of_dense_layers_maps_both_ways():
    """interleave_moe_layer_step=2 is moe_every=2 and is written back with its moe_layers."""
    import test_hf_llama4

    cfg = hf_config.config_from_hf({**test_hf_llama4.LLAMA4, "interleave_moe_layer_step": 2})
    written = hf_config.config_to_hf(cfg)
    assert (cfg.moe_every, written["interleave_moe_layer_step"], written["moe_layers"]) == (2, 2, [1, 3])
    assert hf_config.config_from_hf(written) == cfg


@pytest.fixture(scope="module")
def maverick_run():
    """Maverick's layout on 8 layers: every 4th layer NoPE, every 2nd MoE (patterns of two groups), default rotary;
    the plain-JAX Llama 4's result of 3 SGD steps whose targets are the next token id (so the losses fall)."""
    import optax

    import reference as reference_lib
    import reference_llama4
    import test_hf_llama4
    from helpers import copy_state, single_device_plan
    from jaxpar.train.state import init_state

    fields = {**test_hf_llama4.FIELDS, "model_type": "llama4_text", "num_hidden_layers": 8,
              "no_rope_layer_interval": 4, "interleave_moe_layer_step": 2,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = dataclasses.replace(hf_config.config_from_hf(fields), seq_len=16)
    assert (cfg.sliding_pattern, cfg.moe_every) == (4, 2)
    optimizer = optax.sgd(0.5)
    model, state = init_state(lambda: MoeLlama(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, cfg.vocab, (8, 16)) for _ in range(3)]
    batches = [{"inputs": jnp.asarray(x, jnp.int32), "targets": jnp.asarray((x + 1) % cfg.vocab, jnp.int32)}
               for x in inputs]
    expected = reference_lib.train(reference_llama4.loss_fn(cfg), copy_state(state).params, batches, optimizer)
    return model, state, optimizer, batches, expected


@pytest.mark.parametrize("mesh, options", [("data=2,pipe=2,expert=2", {"schedule": "1f1b", "zero": 3}),
                                           ("data=4,tensor=2", {"zero": 2})])
def test_llama4_dense_layers_train_as_one_device(maverick_run, mesh, options):
    """3 SGD steps of the local/global patterns of dense and MoE groups against the plain-JAX Llama 4."""
    family_strategies.assert_matches(maverick_run, mesh, options, f"llama4 interleave_moe_layer_step=2 {mesh}")


def test_llama4_dense_layers_refuse_a_pattern_of_part_groups():
    """A NoPE period that does not hold whole groups of moe_every blocks is refused by name when the blocks run."""
    import test_hf_llama4

    cfg = hf_config.config_from_hf({**test_hf_llama4.LLAMA4, "num_hidden_layers": 6, "no_rope_layer_interval": 2,
                                    "interleave_moe_layer_step": 3})
    model = MoeLlama(cfg, nnx.Rngs(0))
    batch = {"inputs": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32)}
    with pytest.raises(ValueError, match="sliding_pattern=2 with moe_every=3: a local/global pattern must hold whole"):
        model(batch)


def test_peft_adapters_of_a_model_with_two_stacks_of_blocks_are_refused_by_name():
    """PEFT's layer numbering of a dense-and-MoE model's adapters is not written or read: both directions refuse
    it in one line (pointing at the merged export), where the export would otherwise misnumber or fail."""
    from jaxpar.interop import peft
    from jaxpar.models import model_config
    from jaxpar.models.moe import MoeLlamaConfig

    mixed = MoeLlamaConfig(n_layers=4, moe_every=2)
    for cfg in (mixed, dataclasses.replace(mixed, moe_every=1, first_dense=1),
                dataclasses.replace(mixed, moe_every=4, moe_pattern="MDMM"), model_config("deepseek-tiny")):
        with pytest.raises(ValueError, match="dense blocks beside its MoE ones .* --format hf --merge"):
            peft.check_one_stack(cfg, "--format peft")
    peft.check_one_stack(dataclasses.replace(mixed, moe_every=1), "--format peft")  # one stack: nothing to refuse

"""MoE models with dense layers among the MoE ones through the Hugging Face door, against real transformers:
Qwen3-MoE with `decoder_sparse_step` > 1 or `mlp_only_layers` (jaxpar's `moe_every` groups, and a dense prefix of
`first_dense` blocks before them: `mlp_only_layers=[0]`).

One small random float32 model per layout (module fixture, made by transformers and saved with
`save_pretrained`): logits both ways, the export's tensor names (strict reload) and config, greedy generation
token for token, and the imported config trained under a strategy equal to the plain-JAX reference.
"""

import dataclasses
import json

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

FIELDS = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=True, moe_intermediate_size=24)
# layout -> the config fields that make layers 1 and 3 the MoE ones, 0 and 2 dense; a dense first layer; and a
# dense first layer before groups of (dense, MoE) on 5 layers
LAYOUTS = {"decoder_sparse_step": {"decoder_sparse_step": 2},
           "mlp_only_layers": {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]},
           "dense_prefix": {"decoder_sparse_step": 1, "mlp_only_layers": [0]},
           "prefix_and_groups": {"decoder_sparse_step": 1, "mlp_only_layers": [0, 1, 3], "num_hidden_layers": 5}}
# layout -> jaxpar's (first_dense, moe_every, its block stacks)
STACKS = {"decoder_sparse_step": (0, 2, ["dense", "moe"]), "mlp_only_layers": (0, 2, ["dense", "moe"]),
          "dense_prefix": (1, 1, ["moe", "prefix"]), "prefix_and_groups": (1, 2, ["dense", "moe", "prefix"])}


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
    assert (cfg.first_dense, cfg.moe_every, sorted(params["blocks"])) == STACKS[layout]
    theirs = torch_logits(reference, TOKENS)
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
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
    print(f"{layout}: import {imported:.2e}, export {back:.2e}, every layer MoE moves them {every_layer:.2e}")


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode over the groups (dense, then MoE block) token for token against `generate`."""
    _, reference, directory = saved
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(MoeLlama, reference, directory)


@pytest.mark.parametrize("fields, layout", [
    ({"mlp_only_layers": [0, 2]}, (0, 2, 2, [])),
    ({"mlp_only_layers": [0]}, (1, 1, 1, [0])),
    ({"mlp_only_layers": [0, 1, 3], "num_hidden_layers": 5}, (1, 2, 1, [0, 1, 3])),
    ({"mlp_only_layers": [0, 1, 2, 4], "num_hidden_layers": 6}, (2, 2, 2, [1])),
])
def test_a_written_config_names_the_layout_and_reads_back(fields, layout):
    """The import's (first_dense, moe_every) and, without a source, the export's decoder_sparse_step (moe_every
    where the prefix is whole steps, else 1) and the MLP-only layers that step does not make; read back, the same."""
    cfg = hf_config.config_from_hf({**FIELDS, "model_type": "qwen3_moe", **fields})
    written = hf_config.config_to_hf(cfg)
    assert (cfg.first_dense, cfg.moe_every, written["decoder_sparse_step"], written["mlp_only_layers"]) == layout
    assert hf_config.config_from_hf(written) == cfg


@pytest.mark.parametrize("fields, message", [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] make layers \[0, 2, 3\] of 4 MoE layers"),
    ({"mlp_only_layers": [3]}, r"mlp_only_layers=\[3\] make layers \[0, 1, 2\] of 4 MoE layers; jaxpar's are dense"),
    ({"decoder_sparse_step": 3}, r"decoder_sparse_step=3, mlp_only_layers=\[\] make layers \[2\] of 4"),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}, r"make layers \[\] of 4 MoE layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an int >= 1"),
])
def test_layouts_jaxpar_cannot_group_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf({**FIELDS, "model_type": "qwen3_moe", **fields})


@pytest.mark.parametrize("fields, message", [
    ({"first_dense": 1, "moe_every": 2}, "moe_every=2 must be >= 1 and divide n_layers=4 less first_dense=1"),
    ({"first_dense": 4}, r"first_dense=4 must be between 0 and n_layers - 1=3"),
    ({"first_dense": 1, "moe_every": 1, "sliding_window": 8, "sliding_pattern": 2},
     "first_dense=1 with sliding_pattern=2: dense"),
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
    for cfg in (mixed, dataclasses.replace(mixed, moe_every=1, first_dense=1), model_config("deepseek-tiny")):
        with pytest.raises(ValueError, match="dense blocks beside its MoE ones .* --format hf --merge"):
            peft.check_one_stack(cfg, "--format peft")
    peft.check_one_stack(dataclasses.replace(mixed, moe_every=1), "--format peft")  # one stack: nothing to refuse

"""Qwen3-MoE and Gemma 3 (text) through the Hugging Face door, against transformers, and on every strategy.

One small random float32 model per family (module fixture, made by transformers and saved with
`save_pretrained`), with the options that make the family (each shown to change the logits when off):
logits both ways, import -> train -> export (step 1's loss equal to transformers', the export reloaded
strictly, every source config field back, `eval` equal on the checkpoint and its export), greedy
generation token for token, and training the imported config equal to the plain-JAX reference
(tests/reference.py) on each strategy, the widest matrix under the slow mark.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import family_strategies
from jaxpar.cli import main
from jaxpar.interop import hf, hf_config, hf_families, hf_write
from jaxpar.models.llama import Llama
from jaxpar.models.moe import MoeLlama
from test_hf import (TOKENS, assert_greedy_generation_equals_generate, needs_torch, relative, saved_family, torch,
                     torch_logits, transformers)
from test_hf_export import assert_generate_and_eval_equal_the_exports, imported_and_trained, unchanged

slow = pytest.mark.slow
VOCAB = 300
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
# Gemma 3's rotations: the global layers' base and linear scaling, the local layers' own base
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
# model_type -> (transformers config, model class, jaxpar model, the family's own config fields, the options that
# matter: each switched off as transformers config fields)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MoeLlama,
                  {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 24},
                  {"norm_topk_prob": {"norm_topk_prob": False}}),
    # 8 layers in Gemma 3's 5:1 pattern: layers 0-4 local, 5 global, 6-7 local (as the published 26 and 34 end)
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", Llama,
                    {"num_hidden_layers": 8, "tie_word_embeddings": True, "sliding_window": 6,
                     "sliding_window_pattern": 6, "query_pre_attn_scalar": 16, "rope_parameters": GEMMA3_ROPE},
                    {"window": {"sliding_window": 64}, "query_pre_attn_scalar": {"query_pre_attn_scalar": 8},
                     "local rope base": {"rope_parameters": {**GEMMA3_ROPE,
                                                             "sliding_attention": GEMMA3_ROPE["full_attention"]}},
                     "global rope scaling": {"rope_parameters": {**GEMMA3_ROPE, "full_attention": {
                         "rope_type": "default", "rope_theta": 1e5}}},
                     "5:1 pattern": {"sliding_window_pattern": 2}}),
}


def family_model(family: str, **off):
    """A random float32 model of `family` (with `off`'s fields changed); norms perturbed (transformers starts them
    at 1 or 0)."""
    config_class, model_class, _, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**FIELDS, **extra, **off})
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained directory), shared by the tests of one family."""
    return saved_family(request.param, family_model, tmp_path_factory)


def jaxpar_model(family: str, cfg, params):
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(FAMILIES[family][2](cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def reload(family: str, directory):
    """The exported directory in transformers, strictly: `from_pretrained`'s loading report (transformers 5 fuses
    the experts' per-tensor layout as it loads) has nothing missing, unexpected or of another shape."""
    model, info = getattr(transformers, FAMILIES[family][1]).from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.float().eval()


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    family, reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    theirs = torch_logits(reference, TOKENS)
    imported = relative(np.asarray(jaxpar_model(family, cfg, params).logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
    for option, off in FAMILIES[family][4].items():  # each option acts on these rows
        changed = relative(torch_logits(family_model(family, **off), TOKENS), theirs)
        assert changed > 1e-3, (option, changed)
    if cfg.qk_norm:
        path = hf_families.blocks_path(cfg).split("/")
        blocks = functools.reduce(lambda tree, key: tree[key], path, params)
        plain = {**params}
        node = plain
        for key in path[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        node[path[-1]] = {k: v for k, v in blocks.items() if k not in ("q_norm", "k_norm")}
        no_norms = dataclasses.replace(cfg, qk_norm=False)
        changed = relative(np.asarray(jaxpar_model(family, no_norms, plain).logits(jnp.asarray(TOKENS))), theirs)
        assert changed > 1e-3, ("qk_norm", changed)

    with nnx.use_eager_sharding(False):
        ours = FAMILIES[family][2](cfg, nnx.Rngs(7))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (family, [FAMILIES[family][1]])
    back = relative(torch_logits(reload(family, tmp_path / "out"), TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"{family}: import {imported:.2e}, export {back:.2e}")


ROUND_TRIPS = {"qwen3_moe": ("data=2,expert=2,pipe=2", ["--zero", "3"]),
               "gemma3_text": ("data=4,tensor=2", ["--zero", "3"])}


@pytest.fixture(scope="module")
def trained(saved, tmp_path_factory):
    """(family, reference, source directory, checkpoint of 2 steps from import-hf on the family's round-trip mesh,
    the metrics rows)."""
    family, reference, directory = saved
    work = tmp_path_factory.mktemp(f"{family}-run")
    mesh, options = ROUND_TRIPS[family]
    run, rows = imported_and_trained(directory, work, mesh, *options)
    return family, reference, directory, run, rows


@needs_torch
def test_import_train_export_round_trip(trained, tmp_path):
    """import-hf -> 2 steps -> export: step 1's loss is transformers', the export reloads strictly with the trained
    logits and every field of the source config.json."""
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.data.tokens import Batches, default_corpus

    family, reference, directory, run, rows = trained
    batch = Batches(default_corpus(), 8, 16, 0)[0]  # batch 0 of the run
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(batch["targets"]).long().reshape(-1))
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-6, loss_diff

    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "out"), "--format", "hf"]) == 0
    source = json.loads((directory / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert unchanged(source, exported) == []
    with Checkpoints(run, read_only=True) as checkpoints:
        params = checkpoints.read_params(2)
    cfg = hf_config.config_from_hf(exported)
    ours = np.asarray(jaxpar_model(family, cfg, params).logits(jnp.asarray(TOKENS)))
    round_trip = relative(torch_logits(reload(family, tmp_path / "out"), TOKENS), ours)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-4  # the steps changed the weights
    print(f"{family} {ROUND_TRIPS[family]}: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
def test_generate_and_eval_read_the_checkpoint_as_its_export(trained, tmp_path, capsys):
    """`generate` and `eval` on the trained checkpoint equal theirs on its Hugging Face export."""
    _, _, _, run, _ = trained
    assert_generate_and_eval_equal_the_exports(run, tmp_path / "hf", capsys)


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode token for token against `generate`, which here runs past the config's eos_token_id (a
    token the random model emits) as the Generator does without a tokenizer's."""
    family, reference, directory = saved
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(FAMILIES[family][2], reference, directory)


QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 8, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "norm_topk_prob": True}


@pytest.mark.parametrize("fields, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob=false with num_experts_per_tok=2"),
    ({"num_experts_per_tok": 1}, "norm_topk_prob=true with num_experts_per_tok=1"),
    ({"decoder_sparse_step": 3}, "decoder_sparse_step=3"),
    ({"mlp_only_layers": [0, 1]}, r"mlp_only_layers=\[0, 1\] make layers \[\] of 2 MoE layers"),  # none is MoE
    ({"output_router_logits": True}, "output_router_logits=true"),
    ({"num_experts": None}, "num_experts is missing"),
])
def test_qwen3_moe_refuses_what_it_cannot_represent(fields, message):
    config = {k: v for k, v in {**QWEN3_MOE, **fields}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf(config)


def test_qwen3_moe_maps_its_window_and_switch_routing_both_ways():
    """use_sliding_window puts the window on every layer; top-1 without renormalisation is jaxpar's Switch router."""
    cfg = hf_config.config_from_hf({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 16})
    assert (cfg.sliding_window, cfg.sliding_pattern, cfg.qk_norm, cfg.top_k) == (16, 1, True, 2)
    back = hf_config.config_to_hf(cfg)
    assert (back["model_type"], back["use_sliding_window"], back["sliding_window"]) == ("qwen3_moe", True, 16)
    switch = hf_config.config_from_hf({**QWEN3_MOE, "num_experts_per_tok": 1, "norm_topk_prob": False})
    assert hf_config.config_to_hf(switch)["norm_topk_prob"] is False


def test_qwen3_30b_a3b_has_the_published_parameter_counts():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (8 of 128 experts), to the unit from its config.json."""
    from jaxpar.models import model_config
    from jaxpar.planner.model import llama_leaves

    cfg = model_config("qwen3-30b-a3b")
    assert cfg.param_count() == 30_532_122_624 == sum(leaf.size for leaf in llama_leaves(cfg))
    idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_d_ff * cfg.n_layers
    assert cfg.param_count() - idle == 3_353_032_704
    hf_fields = hf_config.config_to_hf(cfg)
    assert (hf_fields["model_type"], hf_fields["num_experts"], hf_fields["moe_intermediate_size"]) == \
        ("qwen3_moe", 128, 768)


def test_gemma3_1b_has_the_published_parameter_count():
    """Gemma 3 1B (google/gemma-3-1b-pt): 999,885,952 parameters from its config.json's shapes, to the unit; its
    26 layers in the 5:1 pattern end with two local ones."""
    from jaxpar.models import model_config
    from jaxpar.models.layer_pattern import layer_window
    from jaxpar.planner.model import llama_leaves

    cfg = model_config("gemma3-1b")
    assert cfg.param_count() == 999_885_952 == sum(leaf.size for leaf in llama_leaves(cfg))
    assert [i for i in range(cfg.n_layers) if layer_window(cfg, i) is None] == [5, 11, 17, 23]
    hf_fields = hf_config.config_to_hf(cfg)
    assert hf_fields["model_type"] == "gemma3_text"
    assert hf_config.config_from_hf(hf_fields) == dataclasses.replace(cfg, seq_len=2048)  # the import's longest


def test_gemma3_1b_is_not_cut_by_a_pipeline(capsys):
    """Its last two layers follow the last whole 5:1 pattern: `plan` and training refuse pipe > 1, naming it."""
    from jaxpar.models import model_config
    from jaxpar.models.layer_pattern import check_pipeline_chunks

    main(["plan", "--model", "gemma3-1b", "--devices", "16", "--device", "h100", "--explain", "data=8,pipe=2"])
    assert "cannot run: 26 layers do not split (in whole local/global patterns of 6) into pipe=2" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match=r"n_layers=26 do not cut into pipe=2 x virtual_stages=1 chunks"):
        check_pipeline_chunks(model_config("gemma3-1b"), 2, 1)


GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 8, "intermediate_size": 96, "head_dim": 8, "sliding_window": 8,
          "sliding_window_pattern": 2}


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "gemma3"}, "model_type='gemma3' .*multimodal.*'gemma3_text'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding_attention.rope_type='linear'"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types .* are not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
])
def test_gemma3_refuses_what_it_cannot_represent(fields, message):
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf({**GEMMA3, **fields})


def test_gemma3_reads_the_rope_fields_of_transformers_4_and_a_single_layer_type():
    """rope_theta, rope_scaling and rope_local_base_freq (transformers 4's fields) are the rotations of
    rope_parameters; where every layer is local, the model rotates by the local base alone."""
    old = hf_config.config_from_hf({**GEMMA3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (old.rope_theta, old.rope_type, old.rope_factor, old.rope_local_theta) == (1e6, "linear", 8.0, 1e4)
    assert hf_config.config_from_hf(hf_config.config_to_hf(old)) == old
    local = hf_config.config_from_hf({**GEMMA3, "sliding_window_pattern": 5, "rope_local_base_freq": 1e4})
    assert (local.sliding_pattern, local.rope_theta, local.rope_type, local.rope_local_theta) == \
        (1, 1e4, "default", None)
    with pytest.raises(ValueError, match="rope_local_theta=100.0 .* sliding_pattern=1"):
        dataclasses.replace(local, rope_local_theta=100.0)


def test_linear_rope_scaling_maps_both_ways_for_every_family():
    """Gemma 3's global scaling (`rope_type="linear"`: frequencies / factor) is transformers' for a Llama too."""
    llama = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 8, "intermediate_size": 96, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    cfg = hf_config.config_from_hf(llama)
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 2.0)
    assert hf_config.config_to_hf(cfg)["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0,
                                                              "factor": 2.0}


# -- training equals the plain-JAX reference -----------------------------------------------------------------

EQUIVALENCE_FIELDS = {"qwen3_moe": {"num_hidden_layers": 4},  # pipe=2 x 2 virtual stages
                      "gemma3_text": {"num_hidden_layers": 8, "sliding_window_pattern": 2}}  # chunks of a pattern


def equivalence_config(family: str):
    """The family's imported config, 4 or 8 layers so that pipe=2 x 2 virtual stages cut whole patterns, on
    16-token sequences."""
    hf_fields = {**FIELDS, **FAMILIES[family][3], "model_type": family, **EQUIVALENCE_FIELDS[family]}
    return dataclasses.replace(hf_config.config_from_hf(hf_fields), seq_len=16)


# Each strategy at least once per family, strategies that compose sharing a compile; the fast suite runs Qwen3-MoE's
# first cell (Gemma 3's distributed training meets transformers' loss in the round trip), the slow one all.
STRATEGIES = {
    "qwen3_moe": {
        "1f1b-expert-zero3": ("data=2,pipe=2,expert=2", {"schedule": "1f1b", "zero": 3}),
        "data": ("data=8", {}, slow),
        "zero1-expert-tensor-sp": ("data=2,expert=2,tensor=2", {"zero": 1, "sequence_parallel": True}, slow),
        "zero2-tensor": ("data=4,tensor=2", {"zero": 2}, slow),
        "context-all-gather": ("data=4,context=2", {"context_form": "all-gather"}, slow),
        "context-ring-expert": ("data=2,context=2,expert=2", {"context_form": "ring"}, slow),
        "interleaved-tensor": ("data=2,pipe=2,tensor=2", {"schedule": "interleaved", "virtual_stages": 2}, slow),
    },
    "gemma3_text": {
        "context-ring-explicit-zero3": ("data=2,context=2,tensor=2",
                                        {"context_form": "ring", "tensor_form": "explicit", "zero": 3}, slow),
        "data": ("data=8", {}, slow),
        "zero1-explicit-sp": ("data=4,tensor=2", {"zero": 1, "tensor_form": "explicit", "sequence_parallel": True},
                              slow),
        "zero2-tensor-sp": ("data=4,tensor=2", {"zero": 2, "sequence_parallel": True}, slow),
        "context-all-gather": ("data=4,context=2", {"context_form": "all-gather"}, slow),
        "1f1b": ("data=4,pipe=2", {"schedule": "1f1b"}, slow),
        "interleaved-tensor": ("data=2,pipe=2,tensor=2", {"schedule": "interleaved", "virtual_stages": 2}, slow),
    },
}
CELLS = [pytest.param(family, name, id=f"{family}-{name}", marks=cell[2:])
         for family, cells in STRATEGIES.items() for name, cell in cells.items()]


@functools.cache
def equivalence(family: str):
    """The initial state, 3 batches and the single-device reference's losses and parameters after 3 SGD steps."""
    cfg = equivalence_config(family)
    return family_strategies.reference_run(lambda: FAMILIES[family][2](cfg, nnx.Rngs(0)), cfg)


@pytest.mark.parametrize("family, strategy", CELLS)
def test_training_matches_the_single_device_reference(family, strategy):
    """3 SGD steps of the family's imported config: every loss and the final parameters within 1e-5."""
    mesh, options = STRATEGIES[family][strategy][:2]
    family_strategies.assert_matches(equivalence(family), mesh, options, f"{family} {strategy}")


def test_qwen3_moe_refuses_the_explicit_tensor_form_before_compiling():
    """The experts split their hidden width by annotations only: tensor_form='explicit' is refused by name."""
    family_strategies.assert_explicit_tensor_form_refused(equivalence("qwen3_moe"))

"""DeepSeek-V3 through the Hugging Face door, against transformers, and on the strategies.

One small random float32 `DeepseekV3ForCausalLM` (module fixture, made by transformers and saved with
`save_pretrained`) with the options that make the family, each shown to change the logits when off: the q latent
(q_lora_rank), YaRN with DeepSeek's mscale pair, the interleaved rotary pairs, group-limited routing, the score
correction bias, norm_topk_prob, the routed scaling factor, the shared experts and the first dense layer. Logits
both ways, import -> train -> export (step 1's loss equal to transformers', the export reloaded strictly, every
source config field back), and training on each strategy equal to one device.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import family_strategies
import reference as reference_lib
from helpers import copy_state, single_device_plan
from jaxpar.cli import main
from jaxpar.interop import hf, hf_config, hf_write
from jaxpar.models.deepseek import DeepseekV3
from jaxpar.train.state import init_state
from test_hf import (TOKENS, assert_greedy_generation_equals_generate, needs_torch, relative, torch, torch_logits,
                     transformers)
from test_hf_export import assert_generate_and_eval_equal_the_exports, imported_and_trained, unchanged

slow = pytest.mark.slow
VOCAB = 300
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
# 3 layers, the first dense; top-3 of 8 experts in 2 of 4 groups, 2 shared experts
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=12,
              qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
              norm_topk_prob=True, max_position_embeddings=128, rope_parameters=YARN, tie_word_embeddings=False,
              num_nextn_predict_layers=0)
# each option switched off, as transformers config fields
OFF = {"q latent": {"q_lora_rank": None}, "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
       "mscale": {"rope_parameters": {**YARN, "mscale": 0.0, "mscale_all_dim": 0.0}},
       "interleaved pairs": {"rope_interleave": False}, "group-limited routing": {"n_group": 1, "topk_group": 1},
       "norm_topk_prob": {"norm_topk_prob": False}, "routed scaling": {"routed_scaling_factor": 1.0},
       "first dense layer": {"first_k_dense_replace": 0}}


def family_model(**off):
    """A random float32 DeepSeek-V3 (with `off`'s fields changed); weights drawn wider than transformers' 0.02, norms
    and the score correction perturbed (transformers starts them at 1 and 0), so that every part matters."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**FIELDS, **off})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, its save_pretrained directory)."""
    directory = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    model = family_model()
    model.save_pretrained(directory)
    return model, directory


def jaxpar_model(cfg, params):
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(DeepseekV3(cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def reload(directory):
    """The exported directory in transformers, strictly (nothing missing, unexpected or of another shape)."""
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.float().eval()


def ours(cfg, params, tokens=TOKENS):
    return np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(tokens)))


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.q_lora_rank, cfg.first_dense, cfg.router_groups, cfg.router_topk_groups, cfg.n_shared_experts,
            cfg.rope_type) == (20, 1, 4, 2, 2, "yarn")
    theirs = torch_logits(reference, TOKENS)
    imported = relative(ours(cfg, params), theirs)
    assert imported <= 1e-5, imported
    for option, off in OFF.items():  # each option acts on these rows
        changed = relative(torch_logits(family_model(**off), TOKENS), theirs)
        assert changed > 1e-3, (option, changed)
    # the parts transformers has no switch for, off in jaxpar: the score correction and the shared experts
    moe = params["blocks"]["moe"]
    for option, names in {"score correction": ("router_correction",),
                          "shared experts": ("shared_gate", "shared_up", "shared_down")}.items():
        zeroed = {**moe, **{k: np.zeros_like(moe[k]) for k in names}}
        changed = relative(ours(cfg, {**params, "blocks": {**params["blocks"], "moe": zeroed}}), theirs)
        assert changed > 1e-3, (option, changed)

    with nnx.use_eager_sharding(False):
        model = DeepseekV3(cfg, nnx.Rngs(7))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(model)), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    back = relative(torch_logits(reload(tmp_path / "out"), TOKENS), np.asarray(model.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"deepseek_v3: import {imported:.2e}, export {back:.2e}")


@needs_torch
def test_plain_q_projection_matches_transformers(tmp_path):
    """q_lora_rank None: the queries through q_proj, no latent."""
    reference = family_model(q_lora_rank=None)
    reference.save_pretrained(tmp_path / "hf")
    cfg, params = hf.load_hf_params(tmp_path / "hf")
    assert cfg.q_lora_rank is None and "wq" in params["blocks"]["moe"]
    error = relative(ours(cfg, params), torch_logits(reference, TOKENS))
    assert error <= 1e-5, error


@pytest.fixture(scope="module")
def trained(saved, tmp_path_factory):
    """(reference, source directory, checkpoint of 2 steps from import-hf on data=4,expert=2 with ZeRO-3, the
    metrics rows)."""
    reference, directory = saved
    work = tmp_path_factory.mktemp("deepseek-run")
    run, rows = imported_and_trained(directory, work, "data=4,expert=2", "--zero", "3")
    return reference, directory, run, rows


@needs_torch
def test_import_train_export_round_trip(trained, tmp_path):
    """import-hf -> 2 steps -> export: step 1's loss is transformers', the export reloads strictly with the trained
    logits and every field of the source config.json."""
    from jaxpar.data.tokens import Batches, default_corpus
    from jaxpar.train.checkpoint import Checkpoints

    reference, directory, run, rows = trained
    batch = Batches(default_corpus(), 8, 16, 0)[0]  # batch 0 of the run
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    targets = torch.tensor(batch["targets"]).long().reshape(-1)
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets)
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-6, loss_diff

    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "out"), "--format", "hf"]) == 0
    source = json.loads((directory / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert unchanged(source, exported) == []
    with Checkpoints(run, read_only=True) as checkpoints:
        params = checkpoints.read_params(2)
    trained_logits = ours(hf_config.config_from_hf(exported), params)
    round_trip = relative(torch_logits(reload(tmp_path / "out"), TOKENS), trained_logits)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), trained_logits) > 1e-4  # the steps changed the weights
    correction = np.stack([layer.mlp.gate.e_score_correction_bias.numpy() for layer in reference.model.layers[1:]])
    assert np.array_equal(params["blocks"]["moe"]["router_correction"], correction)  # no gradient, no decay
    print(f"deepseek_v3 data=4,expert=2 zero 3: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
def test_generate_and_eval_read_the_checkpoint_as_its_export(trained, tmp_path, capsys):
    """`generate` and `eval` on the trained checkpoint equal theirs on its Hugging Face export."""
    _, _, run, _ = trained
    assert_generate_and_eval_equal_the_exports(run, tmp_path / "hf", capsys)


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The compressed-cache decode token for token against `generate` (left-padded prompts of two lengths), past
    the config's eos_token_id as the Generator runs without a tokenizer's."""
    reference, directory = saved
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(DeepseekV3, reference, directory)


@needs_torch
def test_padded_logits_and_the_cache_hold_the_compressed_tokens(saved):
    """A right-padded row's real tokens get transformers' logits; the cache keeps kv_lora_rank + qk_rope_head_dim
    numbers per token and layer, and a prompt then tokens one at a time decode to the one-call logits."""
    reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    model = jaxpar_model(cfg, params)
    mask = np.ones(TOKENS.shape, bool)
    mask[0, 18:] = False
    padded = np.asarray(model.logits(jnp.asarray(TOKENS), mask=jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    assert relative(padded[mask], torch_logits(reference, TOKENS, mask, positions)[mask]) <= 1e-5
    cache = model.init_cache(2, 24)
    compressed = {k: v.shape for k, v in cache.items() if v.ndim == 4}
    assert compressed == {"latent": (3, 2, 24, 24), "rope_key": (3, 2, 24, 8)}
    prefill, cache = model.decode(jnp.asarray(TOKENS[:, :20]), cache)  # a prompt, then one token at a time
    steps = [np.asarray(prefill)]
    for i in range(20, TOKENS.shape[1]):
        logits, cache = model.decode(jnp.asarray(TOKENS[:, i:i + 1]), cache)
        steps.append(np.asarray(logits))
    assert relative(np.concatenate(steps, 1), np.asarray(model.logits(jnp.asarray(TOKENS)))) <= 1e-5
    with pytest.raises(ValueError, match="segment_ids .packed documents. are not supported by DeepSeek-V3"):
        model.logits(jnp.asarray(TOKENS), segment_ids=jnp.ones(TOKENS.shape, jnp.int32))


DEEPSEEK = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 0}


@pytest.mark.parametrize("fields, message", [
    ({"output_router_logits": True}, "output_router_logits=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"n_group": 3}, "n_groups=3 must divide n_experts=8"),
    ({"num_experts_per_tok": 8}, "top_k=8 is more than the 1 chosen groups of 4 experts hold"),
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even"),
    ({"first_k_dense_replace": 4}, "first_dense=4 must be between 0 and n_layers - 1=3"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported: DeepSeek-V3's is 'sigmoid'"),
    ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
])
def test_deepseek_refuses_what_it_cannot_represent(fields, message):
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf({**DEEPSEEK, **fields})


@needs_torch
def test_multi_token_prediction_layers_are_ignored_with_a_warning(saved, tmp_path):
    """A checkpoint with a prediction layer past the model's (DeepSeek-V3's model.layers.61) imports with a warning,
    its tensors unread, as transformers loads it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    _, directory = saved
    shutil.copytree(directory, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1: the multi-token prediction layers are ignored"):
        cfg, params = hf.load_hf_params(tmp_path / "hf")
    assert cfg.n_layers == 3 and params["blocks"]["moe"]["wo"].shape[0] == 2


def test_deepseek_config_maps_both_ways():
    """Every DeepSeek-V3 field back as it came (MLA sizes, routing, dense layers, YaRN's mscale in the scale)."""
    cfg = hf_config.config_from_hf({**DEEPSEEK, "rope_parameters": YARN, "routed_scaling_factor": 2.0})
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim, cfg.router_groups, cfg.routed_scale, cfg.first_dense) \
        == (16, 16, 8, 2, 2.0, 1)
    assert cfg.query_scale == pytest.approx(12**-0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    back = hf_config.config_to_hf(cfg)
    assert (back["model_type"], back["n_group"], back["kv_lora_rank"], back["first_k_dense_replace"]) == \
        ("deepseek_v3", 2, 16, 1)
    assert hf_config.config_from_hf({**back, "rope_parameters": YARN}) == cfg


@needs_torch
def test_deepseek_v3_has_the_published_parameter_counts():
    """DeepSeek-V3 (deepseek-ai/DeepSeek-V3) counted on transformers' own model built on the meta device from the
    published config: 671,026,419,200 parameters without the multi-token prediction module (671B), 37.55B active
    (the shared expert and 8 of 256 routed per MoE layer)."""
    from jaxpar.models import model_config
    from jaxpar.planner.model import Model

    cfg = model_config("deepseek-v3")
    with torch.device("meta"):
        published = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config())
    counted = sum(p.numel() for p in published.parameters())
    counted += sum(b.numel() for name, b in published.named_buffers() if "e_score_correction_bias" in name)
    assert cfg.param_count() == counted == 671_026_419_200
    assert cfg.active_param_count() == 37_552_297_472
    # deepseek-ai/DeepSeek-V3's config.json (its bf16 form: no quantization_config) imports to the built-in shape
    published_json = {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}}
    with pytest.warns(UserWarning, match="multi-token prediction"):
        imported = hf_config.config_from_hf(published_json)
    assert imported == dataclasses.replace(cfg, seq_len=2048)
    planned = Model.named("deepseek-v3")  # what `jaxpar plan` and `inspect` count, read from the model's leaves
    assert planned.params == counted and planned.moe_layers == 58 and planned.pipeline_units == 1
    assert planned.flop_params == cfg.active_param_count() - cfg.padded_vocab * cfg.d_model  # no lookup matmul


# -- training on each strategy equals one device -------------------------------------------------------------

@functools.cache
def equivalence(changes: tuple = ()):
    """(model, initial state, optimizer, 3 batches, 3 SGD steps of the same model on one device, unplaced), the
    family's config with `changes` (field, value pairs)."""
    fields = {**FIELDS, "model_type": "deepseek_v3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
              **dict(changes)}
    cfg = dataclasses.replace(hf_config.config_from_hf(fields), seq_len=16)
    optimizer = optax.sgd(0.5)
    model, state = init_state(lambda: DeepseekV3(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, cfg.vocab, (8, 16)) for _ in range(3)]
    batches = [{"inputs": jnp.asarray(x, jnp.int32), "targets": jnp.asarray((x + 1) % cfg.vocab, jnp.int32)}
               for x in inputs]

    def loss(params, batch):
        return model.merge(params)(batch)

    expected = reference_lib.train(loss, copy_state(state).params, batches, optimizer)
    return model, state, optimizer, batches, expected


STRATEGIES = {
    "expert-tensor-zero3": ("data=2,expert=2,tensor=2", {"zero": 3}),
    "data": ("data=8", {}, slow),
    "textbook-attention-tensor": ("data=4,tensor=2", {"attention": "xla"}, slow),  # the others: flash attention
    "zero1-expert-tensor-sp": ("data=2,expert=2,tensor=2", {"zero": 1, "sequence_parallel": True}, slow),
    "zero2-tensor": ("data=4,tensor=2", {"zero": 2}, slow),
    "context-all-gather": ("data=4,context=2", {"context_form": "all-gather"}, slow),
    "context-ring-expert": ("data=2,context=2,expert=2", {"context_form": "ring"}, slow),
    # no dense block: one stack, which a pipeline cuts (4 MoE blocks, 2 per stage or 1 per virtual stage)
    "1f1b-expert-no-dense": ("data=2,pipe=2,expert=2", {"schedule": "1f1b"}, slow),
    "interleaved-no-dense": ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2}, slow),
}
NO_DENSE = (("first_k_dense_replace", 0), ("num_hidden_layers", 4))


@pytest.mark.parametrize("strategy", [pytest.param(name, marks=cell[2:]) for name, cell in STRATEGIES.items()])
def test_training_matches_one_device(strategy):
    """3 SGD steps: every loss and the final parameters within 1e-5 of the same model on one device."""
    mesh, options = STRATEGIES[strategy][:2]
    run = equivalence(NO_DENSE if strategy.endswith("no-dense") else ())
    family_strategies.assert_matches(run, mesh, options, f"deepseek_v3 {strategy}")


def test_deepseek_refuses_the_explicit_tensor_form_before_compiling():
    """The experts split their hidden width by annotations only: tensor_form='explicit' is refused by name."""
    family_strategies.assert_explicit_tensor_form_refused(equivalence())


# the published layout's 3 dense blocks, then 4 MoE blocks: 2 per stage, or 1 per virtual stage
DENSE_PREFIX = (("first_k_dense_replace", 3), ("num_hidden_layers", 7))


@pytest.mark.parametrize("mesh, options", [("data=2,pipe=2,expert=2", {"schedule": "1f1b"}),
                                           ("data=4,pipe=2", {"schedule": "interleaved", "virtual_stages": 2})])
def test_a_pipeline_runs_the_dense_blocks_with_the_embedding(mesh, options):
    """pipe > 1 with dense first blocks: the stages cut the MoE blocks, the dense ones run before the first stage;
    3 SGD steps equal one device's, the bubble slots filled with NaN (a leak into the loss would show)."""
    from jaxpar.pipeline import executor as pipeline

    with pipeline.bubble_fill(float("nan")):
        family_strategies.assert_matches(equivalence(DENSE_PREFIX), mesh, options,
                                         f"deepseek_v3 3 dense blocks {mesh} {options['schedule']}")
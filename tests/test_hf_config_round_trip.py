"""Every family's config.json through import -> train -> export: the fields come back as they were.

One small random model per family jaxpar imports (made by transformers and saved with `save_pretrained`, its
config's optional fields set: token ids, max_position_embeddings, rope scaling, windows and layer types,
router coefficients, initializer range) is trained one step from `--init-from` and exported with
`export --format hf`. Every field of the source config.json is the export's, and transformers reads both to
the same config, except what training changed: Mistral's source allows 12 positions and is trained on 16-token
rows, so its export's `max_position_embeddings` is 16 (the trained model's reach). The weights change, and
`dtype` is the export's files' own. The families whose round trip the default suite checks elsewhere run under the slow mark.
"""

import json

import pytest

from jaxpar.cli import main
from jaxpar.interop import hf_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SEQ_LEN = 16
COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=False,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0,
              initializer_range=0.05, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4})
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 5e5}
ALTERNATING = ["sliding_attention", "full_attention"]
QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=8, layer_types=ALTERNATING, max_window_layers=1)
GEMMA2 = dict(query_pre_attn_scalar=16, attn_logit_softcapping=20.0, final_logit_softcapping=7.0, sliding_window=6,
              layer_types=ALTERNATING, tie_word_embeddings=True)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
# model_type -> (transformers config class, model class, the family's optional fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "max_position_embeddings": 12}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"sliding_window": 8, "num_local_experts": 4,
                                                        "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN_WINDOW),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**QWEN_WINDOW, "head_dim": 12}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 24,
        "router_aux_loss_coef": 0.02, "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA2, "attn_logit_softcapping": None,
                                                              "final_logit_softcapping": None,
                                                              "rope_parameters": GEMMA3_ROPE}),
    # every 2nd layer NoPE, chunks of 4 positions, the query temperature, one routed expert beside the shared one
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "intermediate_size": 24, "intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1,
        "attention_chunk_size": 4, "no_rope_layer_interval": 2, "floor_scale": 2, "attn_scale": 1.0,
        "router_aux_loss_coef": 0.02, "rope_parameters": LLAMA3_ROPE}),
    # sinks, attention biases, YaRN, the alternating window, a router with bias and the clamped SwiGLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
        "swiglu_limit": 0.2, "router_aux_loss_coef": 0.02, "layer_types": ALTERNATING,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "beta_fast": 8.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}}),
    # latent attention with a q latent, YaRN with DeepSeek's mscale pair, a dense first layer, group-limited
    # sigmoid routing with shared experts
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "n_shared_experts": 2, "routed_scaling_factor": 2.5, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                           "original_max_position_embeddings": 32, "mscale": 0.8,
                                                           "mscale_all_dim": 1.0}}),
}
# the round trips the default suite also checks elsewhere (test_hf_export.py's Mixtral, test_hf_new_families.py's
# Qwen3-MoE and Gemma 3, test_hf_llama4.py's Llama 4, test_hf_gpt_oss.py's gpt-oss, test_hf_deepseek_v3.py's
# DeepSeek-V3, each with its token ids and max_position_embeddings): here under the slow mark
ELSEWHERE = ("mixtral", "qwen3_moe", "gemma3_text", "llama4_text", "gpt_oss", "deepseek_v3")
# what one step of training on SEQ_LEN-token rows changes in a family's config.json
TRAINED = {"mistral": {"max_position_embeddings": SEQ_LEN}}
# the files' dtype: the export's own
FILE_FIELDS = ("dtype", "torch_dtype")


def test_every_family_jaxpar_imports_is_round_tripped():
    assert set(hf_config.FAMILIES) == set(FAMILIES)


@pytest.fixture(scope="module", params=[pytest.param(family, marks=pytest.mark.slow) if family in ELSEWHERE
                                        else family for family in FAMILIES])
def round_trip(request, tmp_path_factory):
    """(family, source config.json, exported config.json) of a model trained 1 step from `--init-from`."""
    family = request.param
    config_class, model_class, fields = FAMILIES[family]
    work = tmp_path_factory.mktemp(family)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    getattr(transformers, model_class)(config).save_pretrained(work / "source")
    assert main(["train", "--init-from", str(work / "source"), "--mesh", "data=8", "--steps", "1",
                 "--batch-size", "8", "--seq-len", str(SEQ_LEN), "--checkpoint-dir", str(work / "run"),
                 "--save-every", "1"]) == 0
    assert main(["export", "--checkpoint-dir", str(work / "run"), "--out", str(work / "hf"), "--format", "hf"]) == 0
    source, exported = (json.loads((work / d / "config.json").read_text()) for d in ("source", "hf"))
    return family, work, source, exported


def test_every_source_field_survives_but_what_training_changed(round_trip):
    family, _, source, exported = round_trip
    trained = TRAINED.get(family, {})
    lost = {k: (v, exported.get(k, "(absent)")) for k, v in source.items()
            if k not in FILE_FIELDS and exported.get(k, KeyError) != trained.get(k, v)}
    assert lost == {}
    assert all(source[k] != v for k, v in trained.items())  # the trained change is a change
    assert exported["dtype"] == "float32"


def test_transformers_reads_the_source_and_export_to_the_same_config(round_trip):
    """With transformers' defaults for what config.json leaves out (`_name_or_path` is where each was read from)."""
    family, work, _, _ = round_trip
    source, exported = (transformers.AutoConfig.from_pretrained(work / d).to_dict() for d in ("source", "hf"))
    changed = {k: (v, exported.get(k)) for k, v in source.items()
               if k not in (*FILE_FIELDS, "transformers_version", "_name_or_path") and exported.get(k) != TRAINED.get(family, {}).get(k, v)}
    assert changed == {}

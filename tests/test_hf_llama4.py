"""Llama 4 (text) through the Hugging Face door, against transformers, and on every strategy.

One small random float32 `Llama4ForCausalLM` (module fixture, made by transformers and saved with
`save_pretrained`) with the options that make the family, each shown to change the logits when off: the
chunked attention of the rotating layers, the NoPE layers, their query temperature, the q/k L2 norm, the
llama3 rotary scaling, the shared expert and the routing that scales the expert's input. Logits both ways,
import -> train -> export (step 1's loss equal to transformers', the export reloaded strictly, every source
config field back, `eval` and `generate` equal on the checkpoint and its export), greedy generation token for
token, packed documents each attending as alone, and training equal to the plain-JAX reference
(tests/reference_llama4.py) on each strategy, the widest matrix under the slow mark.
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
import reference_llama4
from helpers import copy_state, single_device_plan
from jaxpar.cli import main
from jaxpar.interop import hf, hf_config, hf_write
from jaxpar.models.moe import MoeLlama
from jaxpar.train.state import init_state
from test_hf import (TOKENS, assert_greedy_generation_equals_generate, needs_torch, relative, torch, torch_logits,
                     transformers)
from test_hf_export import assert_generate_and_eval_equal_the_exports, imported_and_trained, unchanged

slow = pytest.mark.slow
VOCAB = 300
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
# 4 layers, every 2nd NoPE (layers 1 and 3), chunks of 4 positions, the query temperature rising every 2 positions
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, num_local_experts=4,
              num_experts_per_tok=1, attention_chunk_size=4, no_rope_layer_interval=2, floor_scale=2, attn_scale=1.0,
              max_position_embeddings=128, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
# each option switched off, as transformers config fields
OFF = {"chunked attention": {"attention_chunk_size": 64}, "NoPE layers": {"no_rope_layer_interval": 64},
       "query temperature": {"attn_temperature_tuning": False}, "q/k L2 norm": {"use_qk_norm": False},
       "llama3 rope": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}}


def family_model(**off):
    """A random float32 Llama 4 (with `off`'s fields changed); norms perturbed (transformers starts them at 1) and the
    experts and router drawn wider than transformers' 0.02, so that routing and the gates matter."""
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**FIELDS, **off})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if "experts" in name or "router" in name:
                param.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, its save_pretrained directory)."""
    directory = tmp_path_factory.mktemp("llama4") / "hf"
    model = family_model()
    model.save_pretrained(directory)
    return model, directory


def jaxpar_model(cfg, params):
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoeLlama(cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def reload(directory):
    """The exported directory in transformers, strictly (nothing missing, unexpected or of another shape)."""
    model, info = transformers.Llama4ForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.float().eval()


def without(params, *names):
    """The parameters with the MoE blocks' `names` zeroed (a feed-forward path switched off)."""
    moe = {k: np.zeros_like(v) if k in names else v for k, v in params["blocks"]["moe"].items()}
    return {**params, "blocks": {**params["blocks"], "moe": moe}}


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.sliding_pattern, cfg.global_nope, cfg.attention_chunk, cfg.qk_l2_norm, cfg.top_k) == (2, True, 4, True, 1)
    theirs = torch_logits(reference, TOKENS)
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
    mask = np.ones(TOKENS.shape, bool)
    mask[0, 18:] = False  # a right-padded row: its real tokens' chunks and temperatures as without the padding
    padded = np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS), mask=jnp.asarray(mask)))
    assert relative(padded[mask], torch_logits(reference, TOKENS, mask, np.maximum(np.cumsum(mask, 1) - 1, 0))[mask]) \
        <= 1e-5
    for option, off in OFF.items():  # each option acts on these rows
        changed = relative(torch_logits(family_model(**off), TOKENS), theirs)
        assert changed > 1e-3, (option, changed)
    # the feed-forward's own parts, switched off in jaxpar: the shared expert, and the gate on the expert's input
    no_shared = without(params, "shared_gate", "shared_up", "shared_down")
    output_gate = dataclasses.replace(cfg, sigmoid_input_gate=False)  # jaxpar's softmax top-1 gate on the output
    for option, (config, weights) in {"shared expert": (cfg, no_shared), "input gate": (output_gate, params)}.items():
        changed = relative(np.asarray(jaxpar_model(config, weights).logits(jnp.asarray(TOKENS))), theirs)
        assert changed > 1e-3, (option, changed)

    with nnx.use_eager_sharding(False):
        ours = MoeLlama(cfg, nnx.Rngs(7))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("llama4_text", ["Llama4ForCausalLM"])
    back = relative(torch_logits(reload(tmp_path / "out"), TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"llama4_text: import {imported:.2e}, export {back:.2e}")


@pytest.fixture(scope="module")
def trained(saved, tmp_path_factory):
    """(reference, source directory, checkpoint of 2 steps from import-hf on data=2,expert=2,pipe=2 with ZeRO-3, the
    metrics rows)."""
    reference, directory = saved
    work = tmp_path_factory.mktemp("llama4-run")
    run, rows = imported_and_trained(directory, work, "data=2,expert=2,pipe=2", "--zero", "3")
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
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(batch["targets"]).long().reshape(-1))
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-6, loss_diff

    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "out"), "--format", "hf"]) == 0
    source = json.loads((directory / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert unchanged(source, exported) == []
    with Checkpoints(run, read_only=True) as checkpoints:
        params = checkpoints.read_params(2)
    ours = np.asarray(jaxpar_model(hf_config.config_from_hf(exported), params).logits(jnp.asarray(TOKENS)))
    round_trip = relative(torch_logits(reload(tmp_path / "out"), TOKENS), ours)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-4  # the steps changed the weights
    print(f"llama4_text data=2,expert=2,pipe=2 zero 3: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
def test_generate_and_eval_read_the_checkpoint_as_its_export(trained, tmp_path, capsys):
    """`generate` and `eval` on the trained checkpoint equal theirs on its Hugging Face export."""
    _, _, run, _ = trained
    assert_generate_and_eval_equal_the_exports(run, tmp_path / "hf", capsys)


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode token for token against `generate` (prompts longer than a chunk, decoding across chunk
    boundaries), past the config's eos_token_id as the Generator runs without a tokenizer's."""
    reference, directory = saved
    reference.generation_config.eos_token_id = None
    assert_greedy_generation_equals_generate(MoeLlama, reference, directory)


@needs_torch
def test_packed_documents_attend_in_their_own_chunks(saved):
    """Training on packed rows: each document's loss is the one its logits have alone (chunks counted from each
    document's first position), documents starting off the chunk grid."""
    _, directory = saved
    cfg, params = hf.load_hf_params(directory)
    model = jaxpar_model(dataclasses.replace(cfg, seq_len=16), params)
    rng = np.random.default_rng(1)
    lengths = [[5, 11], [7, 6, 3]]  # per row; the first row's second document starts at position 5
    tokens = rng.integers(0, 250, (2, 17))
    segments = np.concatenate([np.repeat(np.arange(1, len(row) + 1), row)[None] for row in lengths])
    positions = np.concatenate([np.concatenate([np.arange(n) for n in row])[None] for row in lengths])
    inputs, targets = tokens[:, :-1][:, :16], tokens[:, 1:][:, :16]
    weights = np.concatenate([segments[:, 1:], np.zeros((2, 1), int)], 1) == segments  # a target of its own document
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets), "segment_ids": jnp.asarray(segments),
             "positions": jnp.asarray(positions), "loss_weights": jnp.asarray(weights, jnp.float32)}
    from jaxpar.parallel import documents

    with documents.scope(documents.of_batch(batch)):
        loss, _ = model(batch)
    alone = []
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            logits = np.asarray(model.logits(jnp.asarray(inputs[r:r + 1, start:start + n])))[0, : n - 1]
            picked = targets[r, start:start + n - 1]
            alone += list(jax.nn.logsumexp(logits, -1) - logits[np.arange(n - 1), picked])
            start += n
    expected = float(np.sum(alone)) / inputs.size  # the weighted losses over all the rows' targets
    assert abs(float(loss) / expected - 1) <= 1e-5, (float(loss), expected)


LLAMA4 = {"model_type": "llama4_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 8, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
          "num_experts_per_tok": 1}


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "llama4"}, "model_type='llama4' .*vision.*'llama4_text'"),
    ({"num_experts_per_tok": 2}, "num_experts_per_tok=2"),
    ({"interleave_moe_layer_step": 3}, "interleave_moe_layer_step=3"),
    ({"moe_layers": [0, 3]}, r"moe_layers=\[0, 3\]"),
    ({"no_rope_layers": [1, 0, 0, 1]}, r"no_rope_layers=\[1, 0, 0, 1\]"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types="),
    ({"output_router_logits": True}, "output_router_logits=True"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"attention_bias": True}, "attention_bias=true"),
])
def test_llama4_refuses_what_it_cannot_represent(fields, message):
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf({**LLAMA4, **fields})


def test_llama4_config_maps_both_ways():
    """Every Llama 4 field back as it came (the NoPE period, chunks, temperature, norm and experts)."""
    cfg = hf_config.config_from_hf({**LLAMA4, "no_rope_layer_interval": 2, "attention_chunk_size": 16,
                                    "floor_scale": 32, "attn_scale": 0.25})
    assert (cfg.sliding_pattern, cfg.global_nope, cfg.attention_chunk, cfg.temperature_floor, cfg.temperature_scale,
            cfg.d_ff, cfg.expert_d_ff, cfg.shared_expert) == (2, True, 16, 32.0, 0.25, 96, 32, True)
    back = hf_config.config_to_hf(cfg)
    assert (back["no_rope_layers"], back["layer_types"][:2], back["floor_scale"]) == \
        ([1, 0, 1, 0], ["chunked_attention", "full_attention"], 32)
    assert hf_config.config_from_hf(back) == cfg
    with pytest.raises(ValueError, match="shared_expert=True: the Hugging Face family with a shared expert is Llama 4"):
        hf_config.config_to_hf(dataclasses.replace(cfg, sigmoid_input_gate=False))
    every = hf_config.config_from_hf({**LLAMA4, "no_rope_layer_interval": 8, "attention_chunk_size": None})
    assert (every.sliding_pattern, every.global_nope, every.attention_chunk, every.temperature_floor) == \
        (1, False, None, None)


def test_llama4_scout_has_the_published_parameter_counts():
    """Llama 4 Scout's text model (meta-llama/Llama-4-Scout-17B-16E's text_config): 107,769,861,120 parameters
    from its shapes (109B with the vision encoder), 17.17B active (the shared expert and 1 of 16 routed)."""
    from jaxpar.models import model_config
    from jaxpar.planner.model import llama_leaves

    cfg = model_config("llama4-scout")
    assert cfg.param_count() == 107_769_861_120 == sum(leaf.size for leaf in llama_leaves(cfg))
    idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_d_ff * cfg.n_layers
    assert cfg.param_count() - idle == 17_172_894_720
    hf_fields = hf_config.config_to_hf(cfg)
    assert (hf_fields["model_type"], hf_fields["num_local_experts"], hf_fields["intermediate_size"],
            hf_fields["no_rope_layers"][:4], hf_fields["attention_chunk_size"]) == \
        ("llama4_text", 16, 8192, [1, 1, 1, 0], 8192)
    assert hf_config.config_from_hf(hf_fields) == dataclasses.replace(cfg, seq_len=2048, vocab_multiple=128)


# -- training equals the plain-JAX reference -----------------------------------------------------------------

def equivalence_config():
    """The family's imported config with default rotary (the reference's), 8 layers so that pipe=2 x 2 virtual
    stages cut whole NoPE patterns, on 16-token sequences."""
    fields = {**FIELDS, "model_type": "llama4_text", "num_hidden_layers": 8,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return dataclasses.replace(hf_config.config_from_hf(fields), seq_len=16)


@functools.cache
def equivalence():
    """(model, initial state, optimizer, 3 batches, the reference's result after 3 SGD steps); targets are the next
    token id, which the steps learn (so the losses fall)."""
    cfg = equivalence_config()
    optimizer = optax.sgd(0.5)
    model, state = init_state(lambda: MoeLlama(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, cfg.vocab, (8, 16)) for _ in range(3)]
    batches = [{"inputs": jnp.asarray(x, jnp.int32), "targets": jnp.asarray((x + 1) % cfg.vocab, jnp.int32)}
               for x in inputs]
    expected = reference_lib.train(reference_llama4.loss_fn(cfg), copy_state(state).params, batches, optimizer)
    return model, state, optimizer, batches, expected


STRATEGIES = {
    "1f1b-expert-zero3": ("data=2,pipe=2,expert=2", {"schedule": "1f1b", "zero": 3}),
    "data": ("data=8", {}, slow),
    "zero1-expert-tensor-sp": ("data=2,expert=2,tensor=2", {"zero": 1, "sequence_parallel": True}, slow),
    "zero2-tensor": ("data=4,tensor=2", {"zero": 2}, slow),
    "context-all-gather": ("data=4,context=2", {"context_form": "all-gather"}, slow),
    "context-ring-expert": ("data=2,context=2,expert=2", {"context_form": "ring"}, slow),
    "interleaved-tensor": ("data=2,pipe=2,tensor=2", {"schedule": "interleaved", "virtual_stages": 2}, slow),
}


@pytest.mark.parametrize("strategy", [pytest.param(name, marks=cell[2:]) for name, cell in STRATEGIES.items()])
def test_training_matches_the_single_device_reference(strategy):
    """3 SGD steps: every loss and the final parameters within 1e-5 of the plain-JAX Llama 4."""
    mesh, options = STRATEGIES[strategy][:2]
    family_strategies.assert_matches(equivalence(), mesh, options, f"llama4_text {strategy}")


def test_llama4_refuses_the_explicit_tensor_form_before_compiling():
    """The experts split their hidden width by annotations only: tensor_form='explicit' is refused by name."""
    family_strategies.assert_explicit_tensor_form_refused(equivalence())

"""Hugging Face families beyond Llama: Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) against transformers.

One small random float32 model per family (module fixture): logits both ways, an import -> train -> export
round trip reloaded with `load_state_dict(strict=True)`, and step 1's loss equal to transformers' on that batch.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference as reference_lib
from helpers import copy_state, max_relative_error, single_device_plan
from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.interop import hf, hf_config, hf_families, hf_write
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step
from test_hf import (TOKENS, assert_greedy_generation_equals_generate,
                     jaxpar_model, needs_torch, relative, saved_family, torch, torch_logits, transformers)

FIELDS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=128)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # head_dim != hidden / heads
}


def family_model(family: str):
    """A random float32 model of `family`; norms and biases perturbed (transformers starts them at 1 and 0)."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**FIELDS, **extra)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained directory), shared by the tests of one family."""
    return saved_family(request.param, family_model, tmp_path_factory)


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    family, reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))), torch_logits(reference, TOKENS))
    assert imported <= 1e-5, imported
    without = dataclasses.replace(cfg, qkv_bias=False, qk_norm=False)
    stripped = {**params, "blocks": {k: v for k, v in params["blocks"].items() if k in hf_families.LAYER_PARAMS}}
    plain = relative(np.asarray(jaxpar_model(without, stripped).logits(jnp.asarray(TOKENS))), torch_logits(reference, TOKENS))
    assert plain > 1e-3, plain  # the family's block option matters to these logits

    with nnx.use_eager_sharding(False):
        ours = Llama(cfg, nnx.Rngs(7))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (family, [FAMILIES[family][1]])
    exported = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "out").float().eval()
    back = relative(torch_logits(exported, TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"{family}: import {imported:.2e}, export {back:.2e}")


@needs_torch
def test_import_train_export_round_trip(saved, tmp_path):
    """import-hf -> train on data=2,tensor=4 (2 KV heads, each on 2 ranks) -> export: strict load in the family's class, same logits."""
    from safetensors.torch import load_file

    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.data.tokens import Batches, default_corpus

    family, reference, directory = saved
    assert main(["import-hf", str(directory), "--out", str(tmp_path / "imported")]) == 0
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--init-from", str(tmp_path / "imported"), "--mesh", "data=2,tensor=4", "--steps", "4",
                 "--batch-size", "4", "--seq-len", "16", "--checkpoint-dir", str(tmp_path / "run"),
                 "--save-every", "4", "--metrics", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    batch = Batches(default_corpus(), 4, 16, 0)[0]  # batch 0 of the run (no --eval-every: no held-out split)
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.tensor(batch["targets"]).long().reshape(-1))
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-5, loss_diff

    assert main(["export", "--checkpoint-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    model_class = getattr(transformers, FAMILIES[family][1])
    exported = model_class(model_class.config_class.from_pretrained(tmp_path / "out")).float().eval()
    exported.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    with Checkpoints(tmp_path / "run", read_only=True) as checkpoints:
        trained = checkpoints.read_params(4)
    cfg = hf_config.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    ours = np.asarray(jaxpar_model(cfg, trained).logits(jnp.asarray(TOKENS)))
    round_trip = relative(torch_logits(exported, TOKENS), ours)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-4  # the steps changed the weights
    print(f"{family}: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
@pytest.mark.parametrize("family, window_fields", [
    ("qwen2", {"max_window_layers": 0}),  # every layer local, as transformers derives it
    ("qwen3", {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}),
])
def test_qwen_sliding_windows_match_transformers(family, window_fields, tmp_path):
    """use_sliding_window=true on the layers transformers makes local: logits within 1e-5 both ways, and the window
    matters to them (> 1e-3 without it); the export says the same layers are local."""
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**FIELDS, **extra, "use_sliding_window": True,
                                                    "sliding_window": 5, **window_fields})
    reference = getattr(transformers, model_class)(config).float().eval()
    reference.save_pretrained(tmp_path / "hf")
    cfg, params = hf.load_hf_params(tmp_path / "hf")
    assert (cfg.sliding_window, cfg.sliding_pattern) == (5, 1 if family == "qwen2" else 2)
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))),
                        torch_logits(reference, TOKENS))
    assert imported <= 1e-5, imported
    full = dataclasses.replace(cfg, sliding_window=None, sliding_pattern=1)
    unwindowed = relative(np.asarray(jaxpar_model(full, params).logits(jnp.asarray(TOKENS))),
                          torch_logits(reference, TOKENS))
    assert unwindowed > 1e-3, unwindowed

    hf_write.write_hf(params, cfg, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["use_sliding_window"], exported["sliding_window"]) == (True, 5)
    assert exported["layer_types"] == reference.config.layer_types
    back = getattr(transformers, model_class).from_pretrained(tmp_path / "out").float().eval()
    assert relative(torch_logits(back, TOKENS), torch_logits(reference, TOKENS)) <= 1e-5


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
         "max_window_layers=1 with use_sliding_window=true.*first 1 layers global and the other 1 local have no period"),
        ({"model_type": "qwen2", "layer_types": ["sliding_attention", "full_attention"]},
         r"layer_types \['sliding_attention'\] with use_sliding_window=false"),
        ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
         "sliding_window=None with sliding_attention layers"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true"),
        ({"model_type": "gemma3"}, "model_type='gemma3'"),
    ],
)
def test_refuses_what_the_family_cannot_represent(fields, message):
    config = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
              "intermediate_size": 96, **fields}
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf(config)


# -- training equals the plain-JAX reference (tests/reference.py adds the biases and norms on its own) --------------

EQUIVALENCE_CONFIG = LlamaConfig(vocab=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                                 seq_len=16)


@pytest.mark.parametrize("mesh, options", [("data=2,tensor=2", {}), ("data=2,tensor=4", {"tensor_form": "explicit"}),
                                           ("data=8", {"zero": 3})], ids=["tensor2", "tensor4-explicit", "zero3"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_training_matches_the_single_device_reference(family, mesh, options):
    """3 SGD steps: losses and final parameters on data x tensor (tensor=4: each of the 2 KV heads on 2 ranks), ZeRO-3."""
    cfg = dataclasses.replace(EQUIVALENCE_CONFIG, **hf_config.FAMILIES[family])
    optimizer = optax.sgd(0.5)
    model, state = init_state(lambda: Llama(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    rng = np.random.default_rng(0)
    batches = [{"inputs": jnp.asarray(rng.integers(0, cfg.vocab, (8, cfg.seq_len)), jnp.int32),
                "targets": jnp.asarray(rng.integers(0, cfg.vocab, (8, cfg.seq_len)), jnp.int32)} for _ in range(3)]
    expected = reference_lib.train(reference_lib.loss_fn(cfg), copy_state(state).params, batches, optimizer)

    plan = Plan.create(mesh, devices=jax.devices()[: 4 if mesh.endswith("2") else 8], **options)
    placed = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    assert np.max(np.abs(np.array(losses) / expected.losses - 1)) <= 1e-5
    params = jax.device_get(placed.params)
    assert max_relative_error(params, expected.params) <= 1e-5
    extra = {"qwen2": ("bq", "bk", "bv"), "qwen3": ("q_norm", "k_norm")}[family]
    moved = [max_relative_error(params["blocks"][k], np.asarray(state.params["blocks"][k])) for k in extra]
    assert min(moved) > 1e-4, moved  # the family's own parameters were trained


@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_counts_the_family_parameters(family):
    """The planner's inventory and param_count include the biases / per-head norms the model builds."""
    from jaxpar.planner.model import leaves_of, llama_leaves
    from jaxpar.train.state import describe

    cfg = dataclasses.replace(EQUIVALENCE_CONFIG, **hf_config.FAMILIES[family])
    counted = llama_leaves(cfg)
    traced = leaves_of(describe(lambda: Llama(cfg, nnx.Rngs(0))).logical)
    assert sorted((a.shape, a.names) for a in counted) == sorted((a.shape, a.names) for a in traced)
    assert sum(a.size for a in counted) == cfg.param_count() > EQUIVALENCE_CONFIG.param_count()


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode with the family's biases / per-head norms, token for token against `generate`."""
    family, reference, directory = saved
    assert_greedy_generation_equals_generate(Llama, reference, directory)

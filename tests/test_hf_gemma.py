"""Gemma and Gemma 2 through the Hugging Face door, against transformers, and Gemma 2's training on every strategy.

One small random float32 model per family (module fixture, saved with `save_pretrained`): logits both ways,
step 1's loss equal to transformers' on that batch, import -> train (3D and ZeRO-3) -> export reloaded with
`load_state_dict(strict=True)`, and greedy generation token for token against `generate`. Gemma 2's training on
each strategy equals the independent single-device reference (tests/reference.py) within 1e-5.
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
from jaxpar.interop import hf, hf_config, hf_write
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.pipeline.layer_order import to_natural_order
from jaxpar.train.state import init_state, place_state
from jaxpar.train.step import make_train_step
from test_hf import (TOKENS, assert_greedy_generation_equals_generate,
                     jaxpar_model, needs_torch, relative, saved_family, torch, torch_logits, transformers)

# head_dim 8 != hidden / heads = 16. Gemma 2: soft caps small enough to act on these random logits and scores,
# query_pre_attn_scalar != head_dim, windows of 4 (shorter than TOKENS) on the layers transformers makes local
# (0 and 2 of 4: its default alternation; pipe=2 cuts 2 layers, one pattern, per stage)
FIELDS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=128)
GEMMA2_FIELDS = dict(final_logit_softcapping=0.5, attn_logit_softcapping=1.0, query_pre_attn_scalar=32,
                     sliding_window=4, num_hidden_layers=4)
FAMILIES = {"gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
            "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2_FIELDS)}


def family_model(family: str):
    """A random float32 model of `family`, its (1 + w) norm weights moved off transformers' zeros.

    The projections are scaled up from transformers' std 0.02, so that the blocks rather than the (tied, scaled)
    embedding of the last token decide the next one: greedy generation then varies.
    """
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**FIELDS, **extra})
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            elif "proj" in name:
                param.mul_(8.0)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained directory), shared by the tests of one family."""
    return saved_family(request.param, family_model, tmp_path_factory)


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    family, reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    assert (cfg.mlp_activation, cfg.norm_plus_one, cfg.embed_scale, cfg.tie_embeddings) == ("gelu_tanh", True, True, True)
    gemma2 = (True, 0.5, 1.0, 32**-0.5, 4, 2)
    assert (cfg.post_norms, cfg.final_softcap, cfg.attn_softcap, cfg.query_scale, cfg.sliding_window,
            cfg.sliding_pattern) == (gemma2 if family == "gemma2" else (False, None, None, None, None, 1))
    theirs = torch_logits(reference, TOKENS)
    imported = relative(np.asarray(jaxpar_model(cfg, params).logits(jnp.asarray(TOKENS))), theirs)
    assert imported <= 1e-5, imported
    if family == "gemma2":
        assert np.max(np.abs(theirs)) > 0.5 * 0.5  # logits where tanh is far from linear: the cap acts
        for off in ({"final_softcap": None}, {"attn_softcap": None}, {"query_scale": None},
                    {"sliding_window": None, "sliding_pattern": 1}):
            model = jaxpar_model(dataclasses.replace(cfg, **off), params)
            assert relative(np.asarray(model.logits(jnp.asarray(TOKENS))), theirs) > 1e-3, off  # each option acts

    with nnx.use_eager_sharding(False):
        ours = Llama(cfg, nnx.Rngs(7))
    state = nnx.state(ours)
    for path, leaf in nnx.to_flat_state(state):  # (1 + w) norms start at w = 0: move them so the mapping is tested
        if "norm" in path[-1]:
            leaf.set_value(leaf.get_value() + 0.2 * jax.random.normal(jax.random.key(len(path)), leaf.get_value().shape))
        elif path[-1] == "embedding":  # transformers' std 0.02, not 1: raw logits near the cap, not 100 times it
            leaf.set_value(0.02 * leaf.get_value())
    hf_write.write_hf(nnx.to_pure_dict(state), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (family, [FAMILIES[family][1]])
    exported = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path / "out").float().eval()
    back = relative(torch_logits(exported, TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"{family}: import {imported:.2e}, export {back:.2e}")


@needs_torch
@pytest.mark.parametrize("plan", [["--mesh", "data=2,tensor=2,pipe=2"], ["--mesh", "data=8", "--zero", "3"]],
                         ids=["3d", "zero3"])
def test_import_train_export_round_trip(saved, plan, tmp_path):
    """import-hf -> train -> export: step 1's loss is transformers', a strict load in the family's class, same logits."""
    from safetensors.torch import load_file

    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.data.tokens import Batches, default_corpus

    family, reference, directory = saved
    assert main(["import-hf", str(directory), "--out", str(tmp_path / "imported")]) == 0
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--init-from", str(tmp_path / "imported"), *plan, "--steps", "2", "--batch-size", "8",
                 "--seq-len", "16", "--checkpoint-dir", str(tmp_path / "run"), "--save-every", "2",
                 "--metrics", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    batch = Batches(default_corpus(), 8, 16, 0)[0]  # batch 0 of the run (no --eval-every: no held-out split)
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.tensor(batch["targets"]).long().reshape(-1))
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-5, loss_diff

    assert main(["export", "--checkpoint-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    model_class = getattr(transformers, FAMILIES[family][1])
    exported = model_class(model_class.config_class.from_pretrained(tmp_path / "out")).float().eval()
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert "lm_head.weight" not in tensors  # tied: written once, as transformers' save_pretrained does
    exported.load_state_dict({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, strict=True)
    with Checkpoints(tmp_path / "run", read_only=True) as checkpoints:
        trained = checkpoints.read_params(2)
    cfg = hf_config.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    ours = np.asarray(jaxpar_model(cfg, trained).logits(jnp.asarray(TOKENS)))
    round_trip = relative(torch_logits(exported, TOKENS), ours)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-4  # the steps changed the weights
    print(f"{family} {' '.join(plan)}: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode with GeGLU, (1 + w) norms, scaled embeddings (and Gemma 2's post-norms and cap)."""
    family, reference, directory = saved
    assert_greedy_generation_equals_generate(Llama, reference, directory)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_type": "gemma", "hidden_act": "silu"}, "hidden_act='silu'"),
        ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ({"model_type": "gemma", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"model_type": "gemma2", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"model_type": "gemma2", "num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention",
                                                                            "full_attention"]},
         r"layer_types .* repeat with a period P"),
        ({"model_type": "gemma2", "layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ],
)
def test_refuses_what_gemma_cannot_represent(fields, message):
    config = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 8, "intermediate_size": 96,
              **GEMMA2_FIELDS, "num_hidden_layers": 2, **fields}
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf(config)


# -- Gemma 2 training equals the plain-JAX reference (tests/reference.py writes Gemma's options out on its own) ----

GEMMA2 = LlamaConfig(vocab=250, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16,
                     tie_embeddings=True, final_softcap=2.0, attn_softcap=1.0, query_scale=0.5, sliding_window=4,
                     sliding_pattern=2, **hf_config.family_options("gemma2"))
# (mesh, plan options, in the default run). The cells off by default (-m slow; they pass) keep the suite's time:
# the default ones reach every Gemma code path once (both cross-entropy forms, sequence-split post-norms, the
# context-split windows, ZeRO-3's gathers; the pipeline in test_import_train_export_round_trip's 3D run).
STRATEGIES = {
    "tensor2": ("data=2,tensor=2", {}, True),
    "tensor2-explicit": ("data=2,tensor=2", {"tensor_form": "explicit"}, False),
    "tensor2-sequence": ("data=2,tensor=2", {"sequence_parallel": True}, False),
    "tensor2-explicit-sequence": ("data=2,tensor=2", {"tensor_form": "explicit", "sequence_parallel": True}, True),
    "context4-all-gather": ("data=2,context=4", {"context_form": "all-gather"}, True),
    "context4-ring": ("data=2,context=4", {"context_form": "ring"}, False),
    "pipe2-1f1b": ("data=2,pipe=2", {"schedule": "1f1b"}, False),
    "pipe2-interleaved": ("data=2,pipe=2", {"schedule": "interleaved", "virtual_stages": 2}, False),  # 8 layers
    "zero1": ("data=8", {"zero": 1}, False),
    "zero2": ("data=8", {"zero": 2}, False),
    "zero3": ("data=8", {"zero": 3}, True),
}


@pytest.fixture(scope="module")
def gemma2_reference():
    """n_layers -> (model, initial state, optimizer, 2 batches, the reference's result after 2 SGD steps), made once."""
    made = {}

    def of(n_layers: int):
        if n_layers not in made:
            made[n_layers] = _reference(dataclasses.replace(GEMMA2, n_layers=n_layers))
        return made[n_layers]

    return of


def _reference(cfg: LlamaConfig):
    optimizer = optax.sgd(0.5)
    model, state = init_state(lambda: Llama(cfg, nnx.Rngs(0)), optimizer, single_device_plan())
    params = jax.tree.map(np.array, state.params)  # (1 + w) norms start at w = 0: move them so the convention matters
    rng = np.random.default_rng(1)
    for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        params["blocks"][name] = rng.normal(0, 0.3, params["blocks"][name].shape).astype(np.float32)
    params["final_norm"] = rng.normal(0, 0.3, params["final_norm"].shape).astype(np.float32)
    state = dataclasses.replace(state, params=params)
    batches = [{"inputs": jnp.asarray(rng.integers(0, cfg.vocab, (8, cfg.seq_len)), jnp.int32),
                "targets": jnp.asarray(rng.integers(0, cfg.vocab, (8, cfg.seq_len)), jnp.int32)} for _ in range(2)]
    expected = reference_lib.train(reference_lib.loss_fn(cfg), copy_state(state).params, batches, optimizer)
    return model, state, optimizer, batches, expected


@pytest.mark.parametrize("strategy", [name if default else pytest.param(name, marks=pytest.mark.slow)
                                      for name, (_, _, default) in STRATEGIES.items()])
def test_gemma2_training_matches_the_single_device_reference(strategy, gemma2_reference):
    """2 SGD steps of Gemma 2: GeGLU, (1 + w) norms, post-norms, scaled tied embeddings, capped logits and scores,
    its query scale and local (window 4) / global layers."""
    mesh, options, _ = STRATEGIES[strategy]
    # interleaved: 2 stages x 2 virtual stages, each chunk one whole local/global pattern of 2 layers
    model, state, optimizer, batches, expected = gemma2_reference(8 if "virtual_stages" in options else 4)
    plan = Plan.create(mesh, devices=jax.devices()[: 4 if mesh.endswith("2") else 8], **options)
    placed = place_state(copy_state(state), model, optimizer, plan)
    step = make_train_step(model, lambda m, b: m(b), optimizer, plan)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    loss_error = float(np.max(np.abs(np.array(losses) / expected.losses - 1)))
    assert loss_error <= 1e-5, (losses, expected.losses)
    params = to_natural_order(jax.device_get(placed.params), model.logical, plan)
    param_error = max_relative_error(params, expected.params)
    assert param_error <= 1e-5
    print(f"gemma2 {strategy}: loss {loss_error:.1e}, parameters {param_error:.1e}")


def test_planner_counts_the_gemma2_parameters():
    """The planner's inventory and param_count include the post-norms; gemma2-9b has the published 9,241,705,984."""
    from jaxpar.models import MODELS
    from jaxpar.planner.model import leaves_of, llama_leaves
    from jaxpar.train.state import describe

    counted = llama_leaves(GEMMA2)
    traced = leaves_of(describe(lambda: Llama(GEMMA2, nnx.Rngs(0))).logical)
    assert sorted((a.shape, a.names) for a in counted) == sorted((a.shape, a.names) for a in traced)
    assert sum(a.size for a in counted) == GEMMA2.param_count()
    assert MODELS["gemma2-9b"][1].param_count() == 9_241_705_984


def test_a_checkpoint_from_before_the_gemma_options_is_the_same_llama():
    """Resuming a checkpoint written before these options existed reads them as off (mlp_activation: 'silu')."""
    from jaxpar.train.run_config import differences, with_later_options_off

    current = dataclasses.asdict(LlamaConfig())
    new = ("mlp_activation", "norm_plus_one", "embed_scale", "post_norms", "final_softcap")
    saved = {k: v for k, v in current.items() if k not in new}
    assert differences(with_later_options_off(saved, current), current) == []
    gemma = {**current, "mlp_activation": "gelu_tanh"}
    assert differences(with_later_options_off(saved, gemma), gemma) == ["mlp_activation: (absent) -> gelu_tanh"]

"""Hugging Face Llama interop: logits equal `transformers.LlamaForCausalLM` both ways, sharded loading, refusals, round trip."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.interop import hf, hf_config, hf_write, safetensors_reader, saved_weights
from jaxpar.models.llama import Llama, LlamaConfig

try:  # only the tests against transformers need torch (absent on the Python >= 3.12 CI leg)
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch and transformers (the `test` extra on Python 3.11)")

CASES = {
    "untied-gqa": dict(vocab_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=8),
    "tied": dict(vocab_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True),
    "mha": dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=16),
    "padded-vocab": dict(vocab_size=250, num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "llama3-rope": dict(vocab_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def hf_model(seed=0, **overrides) -> "transformers.LlamaForCausalLM":
    """A random float32 LlamaForCausalLM, norms perturbed away from 1 so their mapping is tested."""
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


def torch_logits(model, tokens, mask=None, positions=None):
    with torch.no_grad():
        kwargs = {}
        if mask is not None:
            kwargs = {"attention_mask": torch.tensor(mask, dtype=torch.long), "position_ids": torch.tensor(positions)}
        return model(torch.tensor(tokens), **kwargs).logits.numpy()


def jaxpar_model(cfg, params) -> Llama:
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(Llama(cfg, nnx.Rngs(1)))
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state)


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def saved_family(family: str, family_model, tmp_path_factory):
    """(family, its transformers model, the save_pretrained directory): the per-family module fixtures' body."""
    directory = tmp_path_factory.mktemp(family) / "hf"
    model = family_model(family)
    model.save_pretrained(directory)
    return family, model, directory


def assert_greedy_generation_equals_generate(model_type, reference, directory):
    """jaxpar's KV-cache greedy decode of `directory`'s weights, token for token against `reference.generate`."""
    from jaxpar.run.generate import Generator, generation_plan
    from jaxpar.train.state import init_state

    cfg, params = hf.load_hf_params(directory)
    model, _ = init_state(lambda: model_type(cfg, nnx.Rngs(0)), optax.sgd(0.1), generation_plan("data=1"))
    prompts = [[5, 17, 42, 99, 3], [250, 8, 61]]
    ours = Generator(model, cfg, params, generation_plan("data=1"), max_new_tokens=12)(prompts, seed=0)[0]
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                        max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert list(tokens) == theirs[0, len(prompt):].tolist()
    assert len(set(ours[0])) > 1 and ours[0] != ours[1], ours  # not one token repeated


TOKENS = np.random.default_rng(0).integers(0, 250, size=(2, 24))


@needs_torch
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_both_ways(case, tmp_path):
    reference = hf_model(**CASES[case])
    reference.save_pretrained(tmp_path / "hf")
    cfg, params = hf.load_hf_params(tmp_path / "hf")
    assert cfg.norm_eps == 1e-6 and cfg.tie_embeddings == CASES[case].get("tie_word_embeddings", False)
    model = jaxpar_model(cfg, params)
    imported = relative(np.asarray(model.logits(jnp.asarray(TOKENS))), torch_logits(reference, TOKENS))
    assert imported <= 1e-5, imported
    if case == "llama3-rope":  # the scaling is mapped and matters at these positions
        assert cfg.rope_type == "llama3"
        plain = jaxpar_model(dataclasses.replace(cfg, rope_type="default"), params)
        assert relative(np.asarray(plain.logits(jnp.asarray(TOKENS))), torch_logits(reference, TOKENS)) > 1e-4

    # the other way: jaxpar's own random weights (norms perturbed) written as Hugging Face safetensors
    with nnx.use_eager_sharding(False):
        ours = Llama(cfg, nnx.Rngs(7))
    ours.final_norm[...] = ours.final_norm[...] * 1.3
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out")
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    back = relative(torch_logits(exported, TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"{case}: import {imported:.2e}, export {back:.2e}")


@needs_torch
def test_padding_mask_and_positions_match_transformers(tmp_path):
    reference = hf_model()
    reference.save_pretrained(tmp_path / "hf")
    cfg, params = hf.load_hf_params(tmp_path / "hf")
    model = jaxpar_model(cfg, params)
    mask = np.ones(TOKENS.shape, bool)
    mask[0, :5] = False  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = np.asarray(model.logits(jnp.asarray(TOKENS), mask=jnp.asarray(mask)))
    theirs = torch_logits(reference, TOKENS, mask, positions)
    assert relative(ours[mask], theirs[mask]) <= 1e-5
    alone = np.asarray(model.logits(jnp.asarray(TOKENS[:1, 5:])))  # the padded row equals its unpadded self
    assert relative(ours[0, 5:], alone[0]) <= 1e-5


def test_loading_reads_each_shard_onto_the_plan(tmp_path, monkeypatch):
    """A Hugging Face directory (written by write_hf, sharded into several files) read shard by shard onto a plan."""
    cfg = LlamaConfig(vocab=250, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=96)
    with nnx.use_eager_sharding(False):
        source = nnx.to_pure_dict(nnx.state(Llama(cfg, nnx.Rngs(3))))
    hf_write.write_hf(source, cfg, tmp_path / "hf", max_shard_bytes=100_000)
    assert (tmp_path / "hf" / safetensors_reader.INDEX_FILE).is_file()
    loaded_cfg, whole = hf.load_hf_params(tmp_path / "hf")
    assert loaded_cfg == dataclasses.replace(cfg, seq_len=loaded_cfg.seq_len)
    plan = Plan.create("data=4,tensor=2", zero=3)
    from jaxpar.models import model_factory
    from jaxpar.train.state import describe

    model = describe(model_factory("tiny", cfg, 0))
    shardings = plan.shardings(plan.param_specs(model.logical))
    reads = []
    original = hf.SafetensorsReader.read
    monkeypatch.setattr(hf.SafetensorsReader, "read",
                        lambda self, name, *index: reads.append((name, original(self, name, *index))) or reads[-1][1])
    _, sharded = hf.load_hf_params(tmp_path / "hf", cfg, shardings)
    for path, array, target, expected, written in zip(
            hf.flat_paths(sharded), jax.tree.leaves(sharded), jax.tree.leaves(shardings), jax.tree.leaves(whole),
            jax.tree.leaves(source)):
        assert array.sharding == target, path
        np.testing.assert_array_equal(np.asarray(array), expected)
        if path in ("embedding", "head"):  # padded vocabulary rows (columns of the head) are zero
            rows, padded = (expected, written) if path == "embedding" else (expected.T, written.T)
            np.testing.assert_array_equal(rows[:250], padded[:250])
            assert not rows[250:].any()
        else:
            np.testing.assert_array_equal(expected, written)
    q_reads = [a.size for name, a in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q_reads and max(q_reads) * 8 == 64 * 64  # each device read only its eighth of the tensor
    embed_reads = [a.size for name, a in reads if name == "model.embed_tokens.weight"]
    assert max(embed_reads) < 250 * 64
    # what --init-from, eval and generate call: the same, and a model of another shape is refused by name
    loaded = saved_weights.load_params(tmp_path / "hf", model, plan)
    for array, expected in zip(jax.tree.leaves(loaded), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(array), expected)
    other = describe(model_factory("tiny", dataclasses.replace(cfg, d_ff=128), 0))
    with pytest.raises(ValueError, match=r"blocks/w_up: saved float32\[2, 64, 96\], model float32\[2, 64, 128\]"):
        saved_weights.load_params(tmp_path / "hf", other, plan)


def test_bfloat16_safetensors_read_and_written(tmp_path):
    """Published checkpoints are bfloat16, which numpy lacks: written and read back through jax on the host."""
    cfg = LlamaConfig(vocab=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                      tie_embeddings=True)
    with nnx.use_eager_sharding(False):
        source = nnx.to_pure_dict(nnx.state(Llama(cfg, nnx.Rngs(0))))
    hf_write.write_hf(source, cfg, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, back = hf.load_hf_params(tmp_path / "bf16")
    rounded = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32), source)
    jax.tree.map(np.testing.assert_array_equal, back, rounded)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention_bias", True, "attention_bias=true"),
        ("mlp_bias", True, "mlp_bias=true"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("pretraining_tp", 2, "pretraining_tp=2"),
        ("rope_scaling", {"rope_type": "longrope", "factor": 4.0}, "rope_scaling.rope_type='longrope'"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0},  # YaRN reads (gpt-oss), but not without its length
         "rope_scaling.original_max_position_embeddings is missing (rope_type='yarn')"),
        ("model_type", "phi3", "model_type='phi3'"),  # mistral is a family now (tests/test_hf_mixtral.py)
    ],
)
def test_refuses_what_the_model_cannot_represent(field, value, message):
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "intermediate_size": 96, field: value}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf_config.config_from_hf(config)


def test_config_of_transformers_4_and_5():
    """Llama 3.2's config.json as transformers 4 writes it (rope_scaling) and as 5 does (rope_parameters)."""
    v4 = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
          "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**v4["rope_scaling"], "rope_theta": 500000.0}
    for config in (v4, v5, {**v5, "rope_scaling": None}, {**v4, "rope_parameters": {"rope_type": "default"}}):
        cfg = hf_config.config_from_hf(config)
        assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta, cfg.norm_eps) == ("llama3", 32.0, 500000.0, 1e-5)
        assert (cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings, cfg.padded_vocab) == (8, 64, True, 128256)
        assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == dataclasses.replace(cfg, seq_len=2048)


@needs_torch
def test_import_train_export_round_trip(tmp_path, capsys):
    """import-hf -> train 20 steps from it -> export --format hf -> transformers strict load, same logits."""
    from jaxpar.data.holdout import split_tokens
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.data.tokens import Batches, default_corpus

    reference = hf_model(vocab_size=300, num_key_value_heads=2)
    reference.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--init-from", str(tmp_path / "imported"), "--mesh", "data=4,tensor=2", "--steps", "20",
                 "--batch-size", "8", "--seq-len", "32", "--checkpoint-dir", str(tmp_path / "run"),
                 "--save-every", "20", "--eval-every", "10", "--metrics", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 20 and "eval_loss" in rows[9] and "eval_loss" in rows[19] and "eval_loss" not in rows[0]

    # step 1's loss is the imported model's loss on batch 0: training started from the Hugging Face weights
    batch = Batches(split_tokens(default_corpus())[0], 8, 32, 0)[0]
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), torch.tensor(batch["targets"], dtype=torch.long).reshape(-1))
    assert abs(rows[0]["loss"] / float(first) - 1) <= 1e-5

    assert main(["export", "--checkpoint-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    from safetensors.torch import load_file

    config = transformers.LlamaConfig.from_pretrained(tmp_path / "out")
    exported = transformers.LlamaForCausalLM(config).float().eval()
    exported.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    with Checkpoints(tmp_path / "run", read_only=True) as checkpoints:
        trained = checkpoints.read_params(20)
    cfg = hf_config.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    ours = np.asarray(jaxpar_model(cfg, trained).logits(jnp.asarray(TOKENS)))
    assert relative(torch_logits(exported, TOKENS), ours) <= 1e-5
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-3  # the 20 steps changed the weights

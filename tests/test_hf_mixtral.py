"""Mixtral and Mistral through the Hugging Face door, against transformers, and their training on every strategy.

One small random float32 model per family (module fixture, saved with `save_pretrained`): logits both ways,
step 1's loss equal to transformers' on the same batch, import -> train (3D, ZeRO-3, and for Mixtral a mesh
with `expert`) -> export reloaded strictly, and greedy generation token for token against `generate`. Training
each family's imported config (Mixtral: an MoE feed-forward in every block, dropless top-2; Mistral: a Llama
with a sliding window) equals the plain-JAX reference (tests/reference.py) on each strategy.
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
from jaxpar.interop import hf, hf_config, hf_write
from jaxpar.models.llama import Llama
from jaxpar.models.moe import MoeLlama
from test_hf import (TOKENS, assert_greedy_generation_equals_generate,
                     needs_torch, relative, saved_family, torch, torch_logits, transformers)

slow = pytest.mark.slow
VOCAB = 300
FIELDS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=128)
WINDOW = 6  # Mistral's sliding window in the tests' models: shorter than their sequences
FAMILIES = {  # model_type -> (transformers config, model class, jaxpar model, the family's own config fields)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MoeLlama,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "mistral": ("MistralConfig", "MistralForCausalLM", Llama, {"sliding_window": WINDOW}),
}


def family_model(family: str):
    """A random float32 model of `family`; norms perturbed (transformers starts them at 1)."""
    config_class, model_class, _, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**FIELDS, **extra)).float().eval()
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
    """The exported directory in transformers, every tensor of the files and of the model matched (strict).

    Mistral's tensors are the model's own: `load_state_dict(strict=True)`. transformers 5 fuses Mixtral's
    per-expert tensors (the Hub's and save_pretrained's layout) as it loads, so there `from_pretrained`'s
    loading report is the strict check: nothing missing, unexpected or of another shape.
    """
    from safetensors.torch import load_file

    model_class = getattr(transformers, FAMILIES[family][1])
    if family == "mistral":
        model = model_class(model_class.config_class.from_pretrained(directory))
        model.load_state_dict(load_file(directory / "model.safetensors"), strict=True)
        return model.float().eval()
    model, info = model_class.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return model.float().eval()


@needs_torch
def test_logits_match_transformers_both_ways(saved, tmp_path):
    family, reference, directory = saved
    cfg, params = hf.load_hf_params(directory)
    if family == "mixtral":
        assert (cfg.n_experts, cfg.top_k, cfg.moe_every, cfg.expert_d_ff, cfg.dropless) == (4, 2, 1, 48, True)
        assert cfg.load_balance_coef == 0.0  # transformers adds no router loss without output_router_logits
    imported = relative(np.asarray(jaxpar_model(family, cfg, params).logits(jnp.asarray(TOKENS))),
                        torch_logits(reference, TOKENS))
    assert imported <= 1e-5, imported
    if family == "mistral":  # the window acts on these 24-token rows
        assert cfg.sliding_window == WINDOW
        full = dataclasses.replace(cfg, sliding_window=None)
        unwindowed = relative(np.asarray(jaxpar_model(family, full, params).logits(jnp.asarray(TOKENS))),
                              torch_logits(reference, TOKENS))
        assert unwindowed > 1e-3, unwindowed

    with nnx.use_eager_sharding(False):
        ours = FAMILIES[family][2](cfg, nnx.Rngs(7))
    hf_write.write_hf(nnx.to_pure_dict(nnx.state(ours)), cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (family, [FAMILIES[family][1]])
    back = relative(torch_logits(reload(family, tmp_path / "out"), TOKENS), np.asarray(ours.logits(jnp.asarray(TOKENS))))
    assert back <= 1e-5, back
    print(f"{family}: import {imported:.2e}, export {back:.2e}")


# The fast suite's run per family puts 3D (Mixtral's with expert for tensor) and ZeRO-3 in one; the slow suite's
# runs them apart, Mixtral's ZeRO-3 with expert and its 3D with tensor.
ROUND_TRIPS = {
    "mixtral": {"3d-expert-zero3": ("data=2,expert=2,pipe=2", ["--zero", "3"]),
                "3d": ("data=2,tensor=2,pipe=2", [], slow), "expert-zero3": ("data=4,expert=2", ["--zero", "3"], slow)},
    "mistral": {"3d-zero3": ("data=2,tensor=2,pipe=2", ["--zero", "3"]),
                "3d": ("data=2,tensor=2,pipe=2", [], slow), "zero3": ("data=8", ["--zero", "3"], slow)},
}


@needs_torch
@pytest.mark.parametrize("run", [pytest.param(0, id="3d+zero3"), pytest.param(1, id="3d", marks=slow),
                                 pytest.param(2, id="zero3", marks=slow)])
def test_import_train_export_round_trip(saved, tmp_path, run):
    """import-hf -> 2 steps on 3D and ZeRO-3 (Mixtral's with expert) -> export: transformers reloads it, same logits."""
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.data.tokens import Batches, default_corpus

    family, reference, directory = saved
    mesh, options = list(ROUND_TRIPS[family].values())[run][:2]
    assert main(["import-hf", str(directory), "--out", str(tmp_path / "imported")]) == 0
    metrics = tmp_path / "m.jsonl"
    assert main(["train", "--init-from", str(tmp_path / "imported"), "--mesh", mesh, *options, "--steps", "2",
                 "--batch-size", "8", "--seq-len", "16", "--checkpoint-dir", str(tmp_path / "run"),
                 "--save-every", "2", "--metrics", str(metrics)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    batch = Batches(default_corpus(), 8, 16, 0)[0]  # batch 0 of the run
    logits = torch.tensor(torch_logits(reference, batch["inputs"]))
    first = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(batch["targets"]).long().reshape(-1))
    loss_diff = abs(rows[0]["loss"] / float(first) - 1)
    assert loss_diff <= 1e-5, loss_diff

    assert main(["export", "--checkpoint-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
                 "--format", "hf"]) == 0
    with Checkpoints(tmp_path / "run", read_only=True) as checkpoints:
        trained = checkpoints.read_params(2)
    cfg = hf_config.config_from_hf(json.loads((tmp_path / "out" / "config.json").read_text()))
    ours = np.asarray(jaxpar_model(family, cfg, trained).logits(jnp.asarray(TOKENS)))
    round_trip = relative(torch_logits(reload(family, tmp_path / "out"), TOKENS), ours)
    assert round_trip <= 1e-5, round_trip
    assert relative(torch_logits(reference, TOKENS), ours) > 1e-4  # the steps changed the weights
    print(f"{family} {mesh} {options}: step-1 loss {loss_diff:.2e}, round trip {round_trip:.2e}")


@needs_torch
def test_greedy_generation_equals_transformers_generate(saved):
    """The KV-cache decode (Mixtral's through the MoE feed-forward), token for token against `generate`."""
    family, reference, directory = saved
    assert_greedy_generation_equals_generate(FAMILIES[family][2], reference, directory)


@pytest.mark.parametrize("fields, message", [
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"output_router_logits": True}, "output_router_logits=true"),
    ({"num_local_experts": None}, "num_local_experts is missing"),
])
def test_refuses_what_the_family_cannot_represent(fields, message):
    config = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
              **fields}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        hf_config.config_from_hf(config)


def test_sliding_windows_map_both_ways():
    """Mistral's and Mixtral's `sliding_window` (null: full attention) is jaxpar's, on every layer, and back."""
    base = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
            "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
    for model_type, window in [("mistral", 4096), ("mistral", None), ("mixtral", 512), ("mixtral", None)]:
        cfg = hf_config.config_from_hf({**base, "model_type": model_type, "sliding_window": window})
        assert (cfg.sliding_window, cfg.sliding_pattern) == (window, 1)
        back = hf_config.config_to_hf(cfg)
        assert back.get("sliding_window") == window
        # a windowless Mistral is a Llama and exports as one; a Mixtral stays a Mixtral
        assert back["model_type"] == ("llama" if (model_type, window) == ("mistral", None) else model_type)


@pytest.mark.parametrize("name, params", [("mistral-7b", 7_241_732_096), ("mixtral-8x7b", 46_702_792_704),
                                          ("qwen2.5-7b", 7_615_616_512), ("qwen3-8b", 8_190_735_360)])
def test_built_in_configs_have_the_published_parameter_counts(name, params):
    """`jaxpar plan --model NAME` / `inspect` know the published shapes: their parameter counts, to the unit."""
    from jaxpar.models import model_config
    from jaxpar.planner.model import llama_leaves

    cfg = model_config(name)
    assert cfg.param_count() == params == sum(leaf.size for leaf in llama_leaves(cfg))


# -- training equals the plain-JAX reference -----------------------------------------------------------------

def equivalence_config(family: str):
    """The family's imported config (4 layers: pipe=2 x 2 virtual stages), on 16-token sequences."""
    hf_fields = {**FIELDS, **FAMILIES[family][3], "model_type": family, "num_hidden_layers": 4}
    return dataclasses.replace(hf_config.config_from_hf(hf_fields), seq_len=16)


# Each strategy at least once per family, strategies that compose sharing a compile. The fast suite runs the
# first cell of each (the pipeline with experts; Mistral's window under the context ring with tensor), the
# slow one (`-m slow`) all of them.
STRATEGIES = {
    "mixtral": {
        "interleaved-expert": ("data=2,pipe=2,expert=2", {"schedule": "interleaved", "virtual_stages": 2}),
        "data": ("data=8", {}, slow),
        "zero1-expert-tensor-sp": ("data=2,expert=2,tensor=2", {"zero": 1, "sequence_parallel": True}, slow),
        "zero2-tensor": ("data=4,tensor=2", {"zero": 2}, slow),
        "zero3-expert": ("data=4,expert=2", {"zero": 3}, slow),
        "context-all-gather": ("data=4,context=2", {"context_form": "all-gather"}, slow),
        "context-ring-expert": ("data=2,context=2,expert=2", {"context_form": "ring"}, slow),
        "1f1b-tensor": ("data=2,pipe=2,tensor=2", {"schedule": "1f1b"}, slow),
    },
    "mistral": {
        "context-ring-tensor": ("data=2,context=2,tensor=2", {"context_form": "ring", "tensor_form": "explicit"}),
        "data": ("data=8", {}, slow),
        "zero1-explicit-sp": ("data=4,tensor=2", {"zero": 1, "tensor_form": "explicit", "sequence_parallel": True},
                              slow),
        "zero2-tensor-sp": ("data=4,tensor=2", {"zero": 2, "sequence_parallel": True}, slow),
        "zero3": ("data=8", {"zero": 3}, slow),
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


def test_mixtral_refuses_the_explicit_tensor_form_before_compiling():
    """The MoE layer's experts split their hidden width by annotations: tensor_form='explicit' is refused by name."""
    family_strategies.assert_explicit_tensor_form_refused(equivalence("mixtral"))


def test_evaluation_takes_moe_models_with_experts_in_every_block():
    """--eval-every runs the logits forward: Mixtral's layout (moe_every=1) has one, a mixed MoE Llama none."""
    from jaxpar.models import model_config
    from jaxpar.run.evaluate import check_evaluable

    check_evaluable("moe-tiny", model_config("moe-tiny", {"moe_every": 1}))
    check_evaluable("tiny", model_config("tiny"))
    with pytest.raises(ValueError, match="moe_every=1, as Mixtral.*moe_every=2"):
        check_evaluable("moe-tiny", model_config("moe-tiny", {"moe_every": 2}))

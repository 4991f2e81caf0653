"""LoRA adapters in and out as PEFT folders, against the real `peft` library, for Llama, Qwen2, Mistral, Gemma 2, Mixtral.

One tiny random transformers model per family (module fixture), trained two steps with `--lora-rank` from
`--init-from` (B != 0 after the first Adam step). Its `export --format peft` on the base through
`peft.PeftModel.from_pretrained`, and its `export --format hf --merge` through transformers, give the logits of
the checkpoint's folded weights; an adapter `peft` makes (random A and B) starts `train --adapter` at peft's logits.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import build_parser, main, resolve
from jaxpar.core.plan import Plan
from jaxpar.interop import hf
from jaxpar.models import model_factory
from jaxpar.parallel import lora
from jaxpar.run.training import prepare
from jaxpar.train.checkpoint import Checkpoints

try:
    import peft
    import torch
    import transformers
except ImportError:  # the Python 3.12 leg has no torch: only the tests without it run there
    peft = torch = transformers = None
needs_peft = pytest.mark.skipif(peft is None, reason="needs torch, transformers and peft (the `test` extra on 3.11)")

RANK, ALPHA, STEPS = 4, 8.0, 2
FIELDS = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=128)
DENSE = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("q", "k", "v", "o")
MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
FAMILIES = {  # family -> (transformers config, model class, the family's own fields, peft's target_modules)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, DENSE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, DENSE),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}, DENSE),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 0.5, "attn_logit_softcapping": 1.0,
                                                     "query_pre_attn_scalar": 8, "sliding_window": 4,
                                                     "tie_word_embeddings": True}, DENSE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}, ATTENTION),  # + fused experts
}
TOKENS = np.random.default_rng(0).integers(0, 290, size=(2, 12))


def family_model(family: str):
    """A random float32 transformers model of `family`, norms and biases moved off their initial 1 and 0."""
    config_class, model_class, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**FIELDS, **extra}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    return model.float().eval()


def base_model(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def jaxpar_logits(cfg, params) -> np.ndarray:
    """The logits of jaxpar's model of `cfg` holding `params` (adapters folded into their weights)."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(model_factory(hf.jaxpar_name(cfg), cfg, 0)())
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, lora.fold(params)))
    return np.asarray(nnx.merge(graphdef, state).logits(jnp.asarray(TOKENS)))


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def train_args(base, *flags):
    return ["train", "--init-from", str(base), "--mesh", "data=8", "--batch-size", "8", "--seq-len", "16", *flags]


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """(family, base directory, checkpoint directory, config, the checkpoint's logits) after STEPS LoRA steps."""
    family = request.param
    work = tmp_path_factory.mktemp(family)
    family_model(family).save_pretrained(work / "base")
    run = work / "run"
    assert main(train_args(work / "base", "--steps", str(STEPS), "--lr", "1e-2", "--lora-rank", str(RANK),
                           "--lora-alpha", str(ALPHA), "--lora-targets", ",".join(DENSE),
                           "--checkpoint-dir", str(run), "--save-every", str(STEPS))) == 0
    _, cfg = hf.saved_model_config(work / "base")
    with Checkpoints(run, read_only=True) as checkpoints:
        params = checkpoints.read_params(STEPS)
    return family, work / "base", run, cfg, jaxpar_logits(cfg, params)


@needs_peft
def test_the_exported_adapter_on_its_base_in_peft_gives_jaxpars_logits(trained, tmp_path):
    family, base, run, _, ours = trained
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "adapter"), "--format", "peft"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, str(base))
    assert config["target_modules"] == sorted(MODULES[t] for t in FAMILIES[family][3])
    if family == "mixtral":  # each expert's gate, up and down: PEFT's LoRA on transformers' fused parameters
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapted = peft.PeftModel.from_pretrained(base_model(base), tmp_path / "adapter").eval()
    error = relative(torch_logits(adapted), ours)
    assert error <= 1e-5, error
    assert relative(torch_logits(base_model(base)), ours) > 1e-3  # the adapters moved the logits
    print(f"{family}: peft adapter {error:.2e}")


@needs_peft
def test_the_merged_export_gives_jaxpars_logits(trained, tmp_path):
    family, _, run, _, ours = trained
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "merged"), "--format", "hf",
                 "--merge"]) == 0
    error = relative(torch_logits(base_model(tmp_path / "merged")), ours)
    assert error <= 1e-5, error
    print(f"{family}: merged {error:.2e}")


@needs_peft
def test_an_adapter_made_by_peft_starts_training_at_peft_logits(trained, tmp_path):
    """peft's own adapter (init_lora_weights=False: A and B random) read by `train --adapter`: step 0's weights.
    Its lora_dropout becomes the plan's (an expert's weights take none: jaxpar refuses dropout there)."""
    family, base, _, cfg, _ = trained
    torch.manual_seed(1)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if family == "mixtral" else None
    dropout = 0.0 if experts else 0.05
    made = peft.get_peft_model(base_model(base), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=[MODULES[t] for t in FAMILIES[family][3]], target_parameters=experts,
        init_lora_weights=False, lora_dropout=dropout))
    made.save_pretrained(tmp_path / "adapter")
    config, options, mesh = resolve(build_parser().parse_args(train_args(base, "--adapter", str(tmp_path / "adapter"))))
    assert (options["lora_rank"], options["lora_alpha"], options["lora_targets"], options["lora_dropout"]) == (
        RANK, ALPHA, DENSE if experts else FAMILIES[family][3], dropout)
    state = prepare(config, Plan.create(mesh, **options)).init()
    ours = jaxpar_logits(cfg, jax.device_get(state.params))
    error = relative(ours, torch_logits(made.eval()))
    assert error <= 1e-5, error
    assert relative(torch_logits(base_model(base)), ours) > 1e-3
    print(f"{family}: peft-made adapter {error:.2e}")


def refusal(argv, capsys) -> str:
    """The one error line of a command refused with exit status 2."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@needs_peft
@pytest.mark.parametrize("trained", ["llama"], indirect=True)
def test_an_adapter_for_another_base_or_with_other_lora_flags_is_refused(trained, tmp_path, capsys):
    _, base, run, _, _ = trained
    adapter = tmp_path / "adapter"
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(adapter), "--format", "peft"]) == 0
    torch.manual_seed(0)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**FIELDS, "hidden_size": 64}))
    other.save_pretrained(tmp_path / "other")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    shapes = refusal(train_args(tmp_path / "other", "--adapter", str(adapter)), capsys)
    assert "mlp.down_proj.lora_B.weight has shape [32, 4], " in shapes and "needs [64, 4]; the adapter was made for " \
        "another base" in shapes
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert f"was made for {base}, not --init-from {tmp_path / 'other'}" in refusal(
        train_args(tmp_path / "other", "--adapter", str(adapter)), capsys)
    assert "--lora-rank 8 conflicts with --adapter" in refusal(
        train_args(base, "--adapter", str(adapter), "--lora-rank", "8"), capsys)
    assert "--merge: " in refusal(["export", "--checkpoint-dir", str(base), "--out", str(tmp_path / "m"),
                                   "--format", "hf", "--merge"], capsys)
    assert "holds LoRA adapters" in refusal(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "m"),
                                             "--format", "hf"], capsys)


@needs_peft
@pytest.mark.parametrize("trained", ["llama"], indirect=True)
def test_a_changed_base_is_refused_on_resume_eval_generate_and_export(trained, tmp_path, capsys):
    """The checkpoint names its base (path and fingerprint); other weights written there are refused."""
    _, base, run, _, _ = trained
    with Checkpoints(run, read_only=True) as checkpoints:
        saved = checkpoints.metadata()["config"]["lora_base"]
    assert saved["path"] == str(base) and len(saved["fingerprint"]) == 64
    kept = tmp_path / "kept"
    shutil.copytree(base, kept)
    try:
        model = family_model("llama")
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        model.save_pretrained(base)  # the same files, sizes and names: other weights
        resumed = train_args(base, "--steps", str(STEPS + 1), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                             "--lora-targets", ",".join(DENSE), "--checkpoint-dir", str(run))
        for argv in (resumed, ["eval", "--checkpoint-dir", str(run)],
                     ["generate", "--checkpoint-dir", str(run), "--prompt", "a"],
                     ["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "x"), "--format", "peft"],
                     ["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "x")]):
            assert f"was trained on {base}, whose weights have changed since" in refusal(argv, capsys), argv
    finally:
        shutil.rmtree(base)
        shutil.copytree(kept, base)


def test_a_bf16_lora_checkpoint_exports_its_frozen_weights_and_fp32_adapters(tmp_path):
    """Under bf16 with ZeRO-1 the fp32 master holds only the adapters; the frozen weights are the held 2-byte ones.
    Each export reads both: the merged weight is W + (alpha / r) A B in numpy, the PEFT pair is A and B transposed."""
    from safetensors.numpy import load_file

    run = tmp_path / "run"
    assert main(["train", "--mesh", "data=8", "--steps", "2", "--batch-size", "8", "--seq-len", "16", "--lr", "1e-2",
                 "--precision", "bf16", "--zero", "1", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                 "--lora-targets", "q,down", "--checkpoint-dir", str(run)]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "all.npz")]) == 0
    saved = np.load(tmp_path / "all.npz")
    blocks = {k.removeprefix("blocks/"): saved[k] for k in saved.files if k.startswith("blocks/")}
    assert {"wq", "wk", "w_down", "wq_lora_a", "w_down_lora_b"} <= set(blocks)  # frozen weights and adapters
    assert np.abs(blocks["wq_lora_b"]).max() > 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "merged"), "--format", "hf",
                 "--merge"]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "peft"), "--format", "peft"]) == 0
    merged, adapter = load_file(tmp_path / "merged" / "model.safetensors"), load_file(
        tmp_path / "peft" / "adapter_model.safetensors")
    for layer in range(blocks["wq"].shape[0]):
        a, b = blocks["w_down_lora_a"][layer], blocks["w_down_lora_b"][layer]
        expected = (blocks["w_down"][layer] + ALPHA / RANK * a @ b).T
        assert np.max(np.abs(merged[f"model.layers.{layer}.mlp.down_proj.weight"] - expected)) <= 1e-6
        module = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        assert np.array_equal(adapter[f"{module}.lora_A.weight"], blocks["wq_lora_a"][layer].T)
        assert np.array_equal(adapter[f"{module}.lora_B.weight"], blocks["wq_lora_b"][layer].reshape(RANK, -1).T)
    untouched = merged["model.layers.0.self_attn.k_proj.weight"]
    assert np.array_equal(untouched, blocks["wk"][0].reshape(blocks["wk"].shape[1], -1).T)


@needs_peft
@pytest.mark.parametrize("trained", ["mixtral"], indirect=True)
def test_what_peft_cannot_hold_is_refused_by_name(trained, tmp_path, capsys):
    """A router adapter has no PEFT form; an adapter naming a Linear the Mixtral lacks is not read, nor a rank-2r
    gate_up_proj adapter whose B is not block-diagonal (no pair of gate's and up's)."""
    from safetensors.numpy import load_file, save_file

    from jaxpar.interop.peft import peft_module

    _, base, run, cfg, _ = trained
    assert peft_module(cfg, "blocks/moe/wq") == "self_attn.q_proj"
    with pytest.raises(ValueError, match=r"^--format peft: the adapter on blocks/moe/router \(block_sparse_moe"
                                         r"\.gate\.weight\) has no PEFT form"):
        peft_module(cfg, "blocks/moe/router")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA,
                                                             "target_modules": ["gate_proj"]}))
    save_file({"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": np.zeros((RANK, 32), np.float32)},
              adapter / "adapter_model.safetensors")
    assert "target_modules gate_proj is no linear layer of" in refusal(train_args(base, "--adapter", str(adapter)),
                                                                        capsys)
    experts = tmp_path / "experts"
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(experts), "--format", "peft"]) == 0
    tensors = load_file(experts / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"
    tensors[name][:cfg.expert_d_ff, RANK * cfg.n_experts:] = 1.0  # up's rank block reaching gate's rows
    save_file(tensors, experts / "adapter_model.safetensors")
    assert f"{name} (rank {2 * RANK}) is not gate's and up's two rank-{RANK} adapters" in refusal(
        train_args(base, "--adapter", str(experts)), capsys)


@needs_peft
@pytest.mark.parametrize("trained", ["mixtral"], indirect=True)
def test_a_jaxpar_exported_expert_adapter_comes_back_with_the_checkpoints_adapters(trained, tmp_path):
    """`--format peft` writes gate's and up's A as one of rank 2r (rank_pattern); `--adapter` reads it back as the
    two rank-r adapters it was: the run's every adapter, exactly (fp32 export), and its logits."""
    family, base, run, cfg, ours = trained
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "adapter"), "--format", "peft"]) == 0
    config, options, mesh = resolve(build_parser().parse_args(train_args(base, "--adapter", str(tmp_path / "adapter"))))
    assert (options["lora_rank"], options["lora_alpha"]) == (RANK, ALPHA)
    state = prepare(config, Plan.create(mesh, **options)).init()
    with Checkpoints(run, read_only=True) as checkpoints:
        saved = checkpoints.read_params(STEPS)
    read = jax.device_get(state.params)
    names = [k for k in saved["blocks"]["moe"] if k.endswith(("_lora_a", "_lora_b"))]
    assert {"expert_gate_lora_a", "expert_up_lora_b", "expert_down_lora_a", "wq_lora_b"} <= set(names)
    for key in names:
        assert np.array_equal(np.asarray(read["blocks"]["moe"][key]), np.asarray(saved["blocks"]["moe"][key])), key
    assert relative(jaxpar_logits(cfg, read), ours) <= 1e-6


def test_lora_dropout_goes_out_in_adapter_config_and_comes_back_without_a_warning(tmp_path, capsys):
    """A run with --lora-dropout 0.1 exports it as PEFT's lora_dropout; `--adapter` reads it back as the plan's
    lora_dropout, silently (a --lora-dropout given says otherwise: how training goes on is the user's choice)."""
    from jaxpar.interop.peft import adapter_options

    run, adapter = tmp_path / "run", tmp_path / "adapter"
    assert main(["train", "--mesh", "data=8", "--steps", "1", "--batch-size", "8", "--seq-len", "16", "--lora-rank",
                 str(RANK), "--lora-targets", "q,down", "--lora-dropout", "0.1", "--checkpoint-dir", str(run)]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(adapter), "--format", "peft"]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    capsys.readouterr()
    assert adapter_options(adapter, {})["lora_dropout"] == 0.1
    assert adapter_options(adapter, {"lora_dropout": 0.0})["lora_dropout"] == 0.0
    assert capsys.readouterr().err == ""

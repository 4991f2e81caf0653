"""What a fine-tuned Hugging Face model's checkpoint keeps, and how it goes out again.

A tiny Mixtral (module fixture) is imported and trained one step from `--init-from`: its checkpoint names the
MoE model, so `generate` and `eval` read it; its export writes the source `config.json` back field by field, and
reads the checkpoint a layer's (an expert's) tensor at a time, verified against the checksums saved with it.
"""

import dataclasses
import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.interop import hf_config
from test_hf import needs_torch, saved_family, torch, transformers
from test_hf_mixtral import family_model as mixtral_model


def run_json(argv, capsys) -> dict:
    """The one JSON object a `--json` command prints (exit status 0 asserted)."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def assert_generate_and_eval_equal_the_exports(run, out, capsys) -> None:
    """`generate` and `eval` on the training checkpoint `run` equal theirs on its Hugging Face export (to `out`)."""
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(out), "--format", "hf"]) == 0
    ask = ["--prompt", "The cat", "--max-new-tokens", "6"]
    generated = run_json(["generate", "--checkpoint-dir", str(run), *ask], capsys)
    assert generated["completions"] == run_json(["generate", "--checkpoint-dir", str(out), *ask], capsys)["completions"]
    evaluated = run_json(["eval", "--checkpoint-dir", str(run), "--seq-len", "16"], capsys)
    exported = run_json(["eval", "--checkpoint-dir", str(out), "--seq-len", "16"], capsys)
    assert evaluated["eval_tokens"] == exported["eval_tokens"] > 0
    assert abs(evaluated["eval_loss"] / exported["eval_loss"] - 1) <= 1e-5


def imported_and_trained(directory, work, mesh: str, *options: str):
    """`import-hf` of `directory` into `work`, then 2 steps from it on `mesh` (batch 8 of 16 tokens) saved at step 2:
    (the checkpoint directory, the metrics rows) — the family files' import -> train -> export round trips."""
    assert main(["import-hf", str(directory), "--out", str(work / "imported")]) == 0
    metrics = work / "m.jsonl"
    assert main(["train", "--init-from", str(work / "imported"), "--mesh", mesh, *options, "--steps", "2",
                 "--batch-size", "8", "--seq-len", "16", "--checkpoint-dir", str(work / "run"),
                 "--save-every", "2", "--metrics", str(metrics)]) == 0
    return work / "run", [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def trained_mixtral(tmp_path_factory):
    """(save_pretrained directory, import-hf directory, checkpoint directory of 1 step trained from --init-from)."""
    _, _, directory = saved_family("mixtral", mixtral_model, tmp_path_factory)
    work = directory.parent
    assert main(["import-hf", str(directory), "--out", str(work / "imported")]) == 0
    assert main(["train", "--init-from", str(work / "imported"), "--mesh", "data=4,expert=2", "--steps", "1",
                 "--batch-size", "8", "--seq-len", "16", "--checkpoint-dir", str(work / "run"),
                 "--save-every", "1"]) == 0
    return directory, work / "imported", work / "run"


@needs_torch
def test_a_mixtral_trained_from_init_from_generates_and_evaluates(trained_mixtral, tmp_path, capsys):
    """The run config names `moe-tiny`, not the --model default; generate and eval on the checkpoint equal theirs
    on its Hugging Face export (the same weights read through the other door)."""
    from jaxpar.train.checkpoint import Checkpoints

    _, _, run = trained_mixtral
    with Checkpoints(run, read_only=True) as checkpoints:
        saved = checkpoints.metadata()["config"]
    assert (saved["model"]["name"], saved["train"]["model"]) == ("moe-tiny", "moe-tiny")
    assert saved["model"]["config"]["n_experts"] == 4
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0

    ask = ["--prompt", "The cat", "--max-new-tokens", "6"]
    generated = run_json(["generate", "--checkpoint-dir", str(run), *ask], capsys)
    assert generated["completions"] == run_json(["generate", "--checkpoint-dir", str(tmp_path / "hf"), *ask],
                                                 capsys)["completions"]
    assert generated["new_tokens"] == 6
    evaluated = run_json(["eval", "--checkpoint-dir", str(run), "--seq-len", "16"], capsys)
    exported = run_json(["eval", "--checkpoint-dir", str(tmp_path / "hf"), "--seq-len", "16"], capsys)
    assert evaluated["eval_tokens"] == exported["eval_tokens"] > 0
    assert abs(evaluated["eval_loss"] / exported["eval_loss"] - 1) <= 1e-5


def unchanged(source: dict, exported: dict) -> list[str]:
    """The source config's fields the export lost or changed (the files' dtype aside)."""
    return [f"{k}: {v!r} -> {exported.get(k, '(absent)')!r}" for k, v in source.items()
            if k not in ("dtype", "torch_dtype") and exported.get(k, KeyError) != v]


@needs_torch
def test_an_export_of_a_trained_mixtral_keeps_its_source_config(trained_mixtral, tmp_path):
    """import -> train on 16-token rows -> export: every field of the source config.json comes back as it was,
    max_position_embeddings (128, not 16), the token ids and router_aux_loss_coef among them."""
    directory, _, run = trained_mixtral
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    source = json.loads((directory / "config.json").read_text())
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert unchanged(source, exported) == []
    # and through a jaxpar export of the checkpoint, whose config carries the run's
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "jaxpar")]) == 0
    assert main(["export", "--checkpoint-dir", str(tmp_path / "jaxpar"), "--out", str(tmp_path / "hf2"),
                 "--format", "hf"]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == exported
    assert (exported["max_position_embeddings"], exported["bos_token_id"], exported["eos_token_id"]) == (128, 1, 2)
    assert exported["router_aux_loss_coef"] == source["router_aux_loss_coef"] == 0.001


@needs_torch
def test_an_export_of_an_imported_qwen2_keeps_its_source_config(tmp_path):
    """A Qwen2 with its token ids, max_window_layers and layer_types: import-hf, then export from the import."""
    from test_hf_families import FIELDS

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**FIELDS, bos_token_id=5, eos_token_id=7, pad_token_id=0, max_window_layers=1,
                                      sliding_window=64)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "source")
    assert main(["import-hf", str(tmp_path / "source"), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", "--checkpoint-dir", str(tmp_path / "imported"), "--out", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    source = json.loads((tmp_path / "source" / "config.json").read_text())
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert unchanged(source, exported) == []
    assert (exported["layer_types"], exported["max_window_layers"]) == (["full_attention"] * 2, 1)
    assert (exported["bos_token_id"], exported["eos_token_id"], exported["pad_token_id"]) == (5, 7, 0)


def test_an_export_writes_what_training_changed_over_its_source_config():
    """The fields the trained config maps to differently are the trained ones; the rest are the source's."""
    source = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 8, "intermediate_size": 96, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 512, "bos_token_id": 128000, "eos_token_id": [128001, 128009],
              "initializer_range": 0.02, "dtype": "bfloat16"}
    cfg = hf_config.config_from_hf(source)
    assert hf_config.config_to_hf(cfg, "float32", source) == {**source, "dtype": "float32", "torch_dtype": "float32"}
    trained = dataclasses.replace(cfg, norm_eps=1e-5, seq_len=1024)
    assert hf_config.config_to_hf(trained, "bfloat16", source) == {
        **source, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}


# -- export a tensor at a time ------------------------------------------------------------------------------


@needs_torch
def test_export_reads_one_layer_at_a_time_and_writes_the_checkpoint(trained_mixtral, tmp_path, monkeypatch):
    """Every block export reads of a training checkpoint is one layer's (one expert's) tensor, never a stacked
    parameter; the files hold the checkpoint's parameters exactly (padded vocabulary rows dropped)."""
    from jaxpar.interop import hf, saved_weights
    from jaxpar.train.checkpoint import Checkpoints

    _, _, run = trained_mixtral
    blocks = []
    opened = saved_weights._tensorstore_parameter

    def recording(saved):
        parameter = opened(saved)
        return saved_weights.SavedParameter(parameter.shape,
                                            lambda index: blocks.append((saved.name, parameter.read(index)))
                                            or blocks[-1][1])

    monkeypatch.setattr(saved_weights, "_tensorstore_parameter", recording)
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    stacked = [(name, block.shape) for name, block in blocks if name.startswith("blocks.")]
    assert stacked and all(shape[0] == 1 for _, shape in stacked)
    experts = [shape for name, shape in stacked if name.startswith("blocks.moe.expert_")]
    assert experts and all(shape[:2] == (1, 1) for shape in experts)  # [layer, expert, ...]: one expert's tensor
    assert {name for name, _ in blocks} == {"embedding", "final_norm", "head"} | {n for n, _ in stacked}

    with Checkpoints(run, read_only=True) as checkpoints:
        saved = checkpoints.read_params()
    _, written = hf.load_hf_params(tmp_path / "hf")
    for path, expected in hf.flat_paths(saved).items():
        got = hf.flat_paths(written)[path]
        if path in ("embedding", "head"):  # the padded vocabulary rows (head columns) are not exported
            rows = slice(0, 300)
            expected, got = (expected[rows], got[rows]) if path == "embedding" else (expected[:, rows], got[:, rows])
        np.testing.assert_array_equal(got, expected, err_msg=path)


def test_block_checksums_add_up_to_the_saved_checksum():
    """The checksum export sums a layer at a time is `jaxpar.train.checksums`' of the whole array."""
    import jax.numpy as jnp

    from jaxpar.interop.saved_weights import _block_checksum
    from jaxpar.train.checksums import checksums

    rng = np.random.default_rng(0)
    for array in (rng.standard_normal((3, 5, 7), np.float32), np.asarray(jnp.asarray(rng.standard_normal((4, 6)),
                                                                                  jnp.bfloat16))):
        layer = array[0].size
        summed = sum(_block_checksum(array[i], i * layer) for i in range(len(array))) % 2**32
        assert summed == checksums({"a": array})["a"] == _block_checksum(array, 0, chunk=11)


def test_a_tensor_is_cast_and_written_a_few_rows_at_a_time(tmp_path, monkeypatch):
    """Transposed (a head's layout) and cast to bf16 in pieces of 2 rows: the file safetensors reads holds the
    whole tensor's cast, bit for bit."""
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jaxpar.interop import hf_write

    monkeypatch.setattr(hf_write, "WRITE_BYTES", 2 * 5 * 2)  # 2 rows of 5 bf16 values
    array = np.random.default_rng(0).standard_normal((5, 7), np.float32).T  # 7 rows, not contiguous
    with hf_write.SafetensorsFile(tmp_path / "t.safetensors", {"w": (7, 5)}, np.dtype(jnp.bfloat16), {}) as writer:
        writer.write("w", array)
    got = load_file(tmp_path / "t.safetensors")["w"]
    assert got.tobytes() == np.ascontiguousarray(array.astype(jnp.bfloat16)).tobytes()


@needs_torch
def test_a_corrupted_parameter_stops_the_export_and_leaves_no_directory(trained_mixtral, tmp_path, monkeypatch,
                                                                       capsys):
    """A parameter whose blocks do not add up to its saved checksum is named, and nothing is left at --out."""
    from jaxpar.interop import saved_weights

    _, _, run = trained_mixtral
    real = saved_weights._Checksums.__init__
    monkeypatch.setattr(saved_weights._Checksums, "__init__", lambda self, saved, where: real(
        self, {**saved, "params/blocks/moe/wq": (saved["params/blocks/moe/wq"] + 1) % 2**32}, where))
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert "params/blocks/moe/wq differs from the checksum" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_export_of_a_zero1_bf16_run_writes_its_fp32_master(tmp_path):
    """ZeRO-1 under bf16 saves an fp32 master beside its bf16 params: the export reads the master, a layer at a
    time, and verifies it against its checksums."""
    import jax
    from flax import nnx

    from jaxpar.core.plan import Plan
    from jaxpar.interop import hf, hf_write
    from jaxpar.models.llama import Llama, LlamaConfig
    from jaxpar.run.training import TrainConfig, make_optimizer
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.run_config import run_config
    from jaxpar.train.state import init_state

    cfg = LlamaConfig(vocab=250, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=16)
    plan = Plan.create("data=4,tensor=2", zero=1, precision="bf16")
    optimizer = make_optimizer(TrainConfig())
    _, state = init_state(lambda: Llama(cfg, nnx.Rngs(0)), optimizer, plan)
    master = jax.device_get(state.opt_state.master)
    assert jax.tree.leaves(state.params)[0].dtype != np.float32  # the params are the bf16 casts
    with Checkpoints(tmp_path / "run", config=run_config(TrainConfig(), cfg, plan)) as checkpoints:
        checkpoints.save(1, state)
    assert hf_write.export_hf(tmp_path / "run", tmp_path / "hf")["step"] == 1
    _, written = hf.load_hf_params(tmp_path / "hf")
    for path, expected in hf.flat_paths(master).items():
        got = hf.flat_paths(written)[path]
        rows = (slice(0, 250),) if path == "embedding" else (slice(None), slice(0, 250)) if path == "head" else ()
        np.testing.assert_array_equal(got[rows], np.asarray(expected)[rows], err_msg=path)

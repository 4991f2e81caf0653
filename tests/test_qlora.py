"""QLoRA: LoRA on a base held as NF4 codes trains like a plain-JAX LoRA on the same dequantized weights, at a
quarter of the base's bytes per device, on data, ZeRO-3 and tensor meshes."""

import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import reference
import reference_lora
from helpers import batches, compile_and_train, copy_state, max_relative_error, single_device_plan
from jaxpar.core.plan import Plan
from jaxpar.models.config import LlamaConfig
from jaxpar.models.llama import Llama
from jaxpar.parallel import lora, quantized_base
from jaxpar.parallel.quantize import NF4
from jaxpar.train.state import init_state, place_state

RANK, ALPHA, STEPS = 4, 8.0, 2
ALL = ("q", "k", "v", "o", "gate", "up", "down")
OPTIMIZER = optax.sgd(0.5, momentum=0.9)
DATA = batches(batch_size=8, seq_len=16)
# head_dim, d_model and d_ff whole blocks of 64 (a tensor=2 shard of d_ff too); still tiny
CONFIG = LlamaConfig(vocab=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=64, d_ff=128, seq_len=16)
MODEL_TABLE = "[model]\nn_layers = 2\nd_model = 64\nn_heads = 2\nn_kv_heads = 2\nhead_dim = 64\nd_ff = 128\n"


def build(kind="nf4"):
    model = Llama(CONFIG, nnx.Rngs(0))
    lora.apply(model, RANK, ALPHA, targets=ALL, rngs=nnx.Rngs(1))
    quantized_base.store(model, kind)
    return model


@functools.cache
def initial():
    """The model and its step-0 state, every B drawn small and random (B = 0 gives A no gradient at first)."""
    model, state = init_state(build, OPTIMIZER, single_device_plan(), trainable=lora.TRAINABLE)
    return model, reference_lora.with_random_b(copy_state(state))


def dequantized(params):
    """The weights the codes stand for, in numpy (high nibble first, NF4 level times its block's absmax)."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = dequantized(value)
        elif key.endswith("_quant_scales"):
            continue
        elif key + "_quant_scales" in params:
            codes, scales = np.asarray(value), np.asarray(params[key + "_quant_scales"])
            levels = NF4[np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], -1)]
            blocks = levels.reshape(*scales.shape, -1) * scales[..., None]
            out[key] = blocks.reshape(levels.shape)
        else:
            out[key] = value
    return out


@functools.cache
def run(mesh: str, **options):
    """(losses, final state on host) of STEPS QLoRA steps on `mesh`."""
    model, state = initial()
    losses, final, _ = compile_and_train(model, state, OPTIMIZER, Plan.create(mesh, **options), DATA, STEPS)
    return losses, final


@functools.cache
def expected():
    return reference_lora.train(CONFIG, dequantized(initial()[1].params), [DATA[i] for i in range(STEPS)], OPTIMIZER,
                                ALPHA / RANK)


MESHES = [
    ("data=8", {}),
    ("data=8", {"zero": 3}),
    ("data=4,tensor=2", {}),
    pytest.param("data=4,tensor=2", {"tensor_form": "explicit"}, marks=pytest.mark.slow),
    pytest.param("data=2,tensor=2,pipe=2", {"schedule": "1f1b", "microbatches": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh,options", MESHES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={o}" for k, o in v.items()) or "-")
def test_qlora_training_matches_plain_jax_lora_on_the_dequantized_base(mesh, options):
    losses, final = run(mesh, **options)
    ref = expected()
    adapters, frozen = reference_lora.split(final.params)
    start = reference_lora.split(initial()[1].params)[1]
    print(f"{mesh} {options}: losses {losses} vs {ref.losses}, adapters' error "
          f"{max_relative_error(adapters, ref.params):.1e}")
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5
    assert max_relative_error(adapters, ref.params) <= 1e-5
    assert jax.tree.all(jax.tree.map(np.array_equal, frozen, start))  # codes and scales never move
    assert first_batch_loss(ref.params) < first_batch_loss(reference_lora.split(dequantized(initial()[1].params))[0])


def first_batch_loss(adapters) -> float:
    """The reference loss of the first batch with `adapters` on the dequantized base: training lowers it (the
    losses of successive steps are of different batches, which differ between Pythons' default corpora)."""
    frozen = reference_lora.split(dequantized(initial()[1].params))[1]
    return float(reference.loss_fn(CONFIG)(reference_lora.effective(frozen, adapters, ALPHA / RANK), DATA[0])[0])


def _bytes_on(x, device) -> int:
    return sum(s.data.nbytes for s in x.addressable_shards if s.device == device)


@pytest.mark.parametrize("mesh,options", MESHES[:3], ids=["data", "zero3", "tensor"])
def test_the_base_takes_under_a_third_of_bf16s_bytes_per_device(mesh, options):
    """Per device: each matrix's codes and scales, as the plan places them, against the bf16 shard of the weight."""
    model, state = initial()
    plan = Plan.create(mesh, **options)
    blocks = place_state(copy_state(state), model, OPTIMIZER, plan).params["blocks"]
    device = plan.mesh.devices.flat[0]
    held = bf16 = 0
    for key, scales in blocks.items():
        if key.endswith("_quant_scales"):
            codes = blocks[key[:-len("_quant_scales")]]
            held += _bytes_on(codes, device) + _bytes_on(scales, device)
            bf16 += 2 * 2 * _bytes_on(codes, device)  # two values a byte, two bytes a value
    print(f"{mesh} {options}: base {held} B per device, bf16 {bf16} B: {held / bf16:.3f}x")
    assert held / bf16 <= 0.3 and held / bf16 == pytest.approx((0.5 + 4 / 64) / 2)


def test_inspect_counts_the_quantized_bytes(tmp_path, capsys):
    """`jaxpar inspect` compiles the step: its argument bytes shrink by exactly what NF4 saves on the fp32 base."""
    from jaxpar.cli import main

    config = tmp_path / "run.toml"
    config.write_text(MODEL_TABLE)
    arguments = {}
    for kind in ("none", "nf4"):
        assert main(["inspect", "--config", str(config), "--mesh", "data=8", "--batch-size", "8", "--seq-len", "16",
                     "--lora-rank", "4", "--lora-targets", "q,v", "--base-dtype", kind, "--json"]) == 0
        arguments[kind] = json.loads(capsys.readouterr().out)["memory"]["arguments"]
    d, hd, f, layers = CONFIG.d_model, CONFIG.head_dim, CONFIG.d_ff, CONFIG.n_layers
    values = layers * (4 * d * 2 * hd + 3 * d * f)  # q, k, v, o and gate, up, down: whole on each data rank
    print(f"inspect arguments per device: fp32 base {arguments['none']} B, nf4 base {arguments['nf4']} B")
    assert arguments["none"] - arguments["nf4"] == values * (4 - 0.5 - 4 / 64)


@pytest.mark.parametrize("flags,message", [
    (["--base-dtype", "nf4"], "base_dtype='nf4' (--base-dtype) quantizes the frozen base of a LoRA run, but "
                              "lora_rank is 0"),
    (["--base-dtype", "int4"], "base_dtype (--base-dtype) must be one of"),
    (["--lora-rank", "4", "--base-dtype", "nf4"], "--base-dtype nf4: blocks/wq's last dimension (8, of shape "
                                                  "[4, 64, 8, 8]) is not a whole number of 64-value blocks"),
])
def test_bad_base_dtypes_are_refused_in_one_line(flags, message, capsys):
    """The default tiny model's head_dim (8) is an eighth of a block."""
    from jaxpar.cli import main

    assert main(["train", "--steps", "1", "--mesh", "data=8", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_device_holding_part_of_a_block_is_refused_in_one_line():
    """d_ff = 128 over tensor=4 leaves 32 values of each row of w_gate / w_up per device: half a block."""
    model, state = initial()
    with pytest.raises(ValueError, match=r"--base-dtype nf4: blocks/w_gate's last dimension \('mlp', 128\) splits "
                                         r"over tensor=4 into 32 per device, not a multiple of the 64-value block"):
        place_state(copy_state(state), model, OPTIMIZER, Plan.create("data=2,tensor=4"))


def test_a_lora_table_sets_the_base_dtype(tmp_path):
    from jaxpar.cli import build_parser, resolve

    config = tmp_path / "run.toml"
    config.write_text('[lora]\nrank = 4\nbase_dtype = "int8"\n')
    _, options, _ = resolve(build_parser().parse_args(["train", "--config", str(config), "--mesh", "data=8"]))
    assert options == {"lora_rank": 4, "base_dtype": "int8"} and Plan.create("data=8", **options).base_dtype == "int8"


def test_weights_read_for_the_base_are_stored_as_their_codes():
    """`--init-from` with `--base-dtype`: the imported weights (here a plain model's) become codes and scales, as NF4
    makes them from those weights; the adapters start as `lora.apply` makes them."""
    from jaxpar.parallel import quantize
    from jaxpar.train.state import describe, state_from_base

    plain = nnx.to_pure_dict(nnx.state(Llama(CONFIG, nnx.Rngs(7)), nnx.Param))
    model, _ = initial()
    state = jax.device_get(state_from_base(plain, build, model, OPTIMIZER, single_device_plan()))
    blocks = state.params["blocks"]
    for name in ("wq", "wo", "w_down"):
        q = quantize.quantize(plain["blocks"][name], "nf4")
        assert np.array_equal(blocks[name], q.codes) and np.array_equal(blocks[name + "_quant_scales"], q.scales)
    assert np.array_equal(state.params["embedding"], plain["embedding"])
    built = jax.device_get(init_state(build, OPTIMIZER, single_device_plan(), trainable=lora.TRAINABLE)[1].params)
    assert np.array_equal(blocks["wq_lora_a"], built["blocks"]["wq_lora_a"])
    assert describe(build, lora.TRAINABLE).logical["blocks"]["wq"].dtype == np.uint8


def test_the_merged_export_of_a_qlora_checkpoint_dequantizes_its_base(tmp_path, capsys):
    """`export --format hf --merge` of an NF4 run writes W + (alpha / r) A B with W the dequantized codes (numpy
    here: the high nibble is the even value, the low the odd one, each level times its block's absmax). `eval` and
    `generate` read the checkpoint as they read a LoRA one: the same weights as the merged export."""
    from safetensors.numpy import load_file

    from jaxpar.cli import main

    config, run = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(MODEL_TABLE)
    assert main(["train", "--config", str(config), "--mesh", "data=8", "--steps", "2", "--batch-size", "8",
                 "--seq-len", "16", "--lr", "1e-2", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
                 "--lora-targets", "q,down", "--base-dtype", "nf4", "--checkpoint-dir", str(run)]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "all.npz")]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "hf"), "--format", "hf",
                 "--merge"]) == 0
    saved = np.load(tmp_path / "all.npz")
    blocks = {k.removeprefix("blocks/"): saved[k] for k in saved.files if k.startswith("blocks/")}
    merged = load_file(tmp_path / "hf" / "model.safetensors")

    def base(name, layer):
        codes, scales = blocks[name][layer], blocks[name + "_quant_scales"][layer]
        values = NF4[np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], -1)]
        return (values.reshape(*scales.shape, 64) * scales[..., None]).reshape(values.shape)

    assert np.abs(blocks["w_down_lora_b"]).max() > 0
    for layer in range(CONFIG.n_layers):
        down = base("w_down", layer) + ALPHA / RANK * blocks["w_down_lora_a"][layer] @ blocks["w_down_lora_b"][layer]
        np.testing.assert_allclose(merged[f"model.layers.{layer}.mlp.down_proj.weight"], down.T, rtol=0, atol=1e-6)
        k = base("wk", layer).reshape(CONFIG.d_model, -1).T  # frozen and not adapted: the codes alone
        np.testing.assert_allclose(merged[f"model.layers.{layer}.self_attn.k_proj.weight"], k, rtol=0, atol=1e-7)

    from jaxpar.interop.saved_weights import load_params
    from jaxpar.run.generate import generation_plan
    from jaxpar.train.state import describe

    plan, model = generation_plan("data=1"), describe(lambda: Llama(CONFIG, nnx.Rngs(0)))
    read, exported = (jax.device_get(load_params(path, model, plan)) for path in (run, tmp_path / "hf"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), read, exported)
    capsys.readouterr()
    for command in (["eval", "--seq-len", "16", "--batch-size", "8"], ["generate", "--prompt", "hi", "--json",
                                                                       "--max-new-tokens", "3"]):
        assert main([command[0], "--checkpoint-dir", str(run), *command[1:]]) == 0, capsys.readouterr().err
        assert main([command[0], "--checkpoint-dir", str(tmp_path / "hf"), *command[1:]]) == 0
        from_checkpoint, from_export = (json.loads(line) for line in capsys.readouterr().out.splitlines()[-2:])
        key = "eval_loss" if command[0] == "eval" else "tokens"
        np.testing.assert_allclose(from_checkpoint[key], from_export[key], rtol=1e-5)


def test_the_readme_states_the_block_size():
    from pathlib import Path

    from jaxpar.parallel.quantize import BLOCK

    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert f"The block size is {BLOCK} (int8's too): every matrix's last dimension must be a multiple of {BLOCK}" \
        in readme


def test_qlora_of_a_dense_prefix_before_moe_blocks_matches_plain_jax_under_zero3():
    """A Qwen3-MoE's dense first layer (`first_dense`, its own stack on the prefix axis): its matrices held as NF4
    codes and adapted like the MoE blocks' attention, trained under ZeRO-3 as the plain-JAX LoRA on the
    dequantized base."""
    from jaxpar.models.moe import MoeLlama, MoeLlamaConfig

    cfg = MoeLlamaConfig(vocab=256, d_model=64, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=64, d_ff=128,
                         seq_len=16, expert_d_ff=64, n_experts=4, top_k=2, moe_every=1, dropless=True, first_dense=1,
                         qk_norm=True)

    def build_prefix():
        model = MoeLlama(cfg, nnx.Rngs(0))
        lora.apply(model, RANK, ALPHA, targets=("q", "v", "gate"), rngs=nnx.Rngs(1))
        quantized_base.store(model, "nf4")
        return model

    model, state = init_state(build_prefix, OPTIMIZER, single_device_plan(), trainable=lora.TRAINABLE)
    state = reference_lora.with_random_b(copy_state(state))
    prefix = state.params["blocks"]["prefix"]
    assert prefix["wq"].dtype == np.uint8 and "w_gate_lora_a" in prefix
    losses, final, _ = compile_and_train(model, copy_state(state), OPTIMIZER, Plan.create("data=8", zero=3), DATA,
                                         STEPS)
    ref = reference_lora.train(cfg, dequantized(state.params), [DATA[i] for i in range(STEPS)], OPTIMIZER,
                               ALPHA / RANK)
    adapters = reference_lora.split(final.params)[0]
    assert np.max(np.abs(losses / ref.losses - 1)) <= 1e-5
    assert max_relative_error(adapters, ref.params) <= 1e-5

"""The planner under LoRA and QLoRA: a frozen base has no gradient, optimizer state or gradient sum, a quantized
one counts its codes' bytes; Mistral-7B fits one 80 GB device, in 24 GB with NF4; the compiler agrees."""

import json

import pytest

from jaxpar.models import model_config
from jaxpar.planner import compare
from jaxpar.planner.adapters import with_lora
from jaxpar.planner.estimate import estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.memory import state_bytes_per_param
from jaxpar.planner.model import Model

from helpers import inspection_as_users_compile

ALL = "q,k,v,o,gate,up,down"
WORK = Workload(batch_size=16, seq_len=32)
# head_dim, d_model and d_ff whole blocks of 64 (what NF4 needs); still tiny
QLORA_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, "head_dim": 64, "d_ff": 128, "seq_len": 32}


def plan_json(capsys, *flags) -> dict:
    from jaxpar.cli import main

    assert main(["plan", "--model", "mistral-7b", "--devices", "1", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_mistral_7b_fits_one_device_with_lora_and_needs_under_24_gb_with_nf4(capsys):
    full = plan_json(capsys)
    lora = plan_json(capsys, "--lora-rank", "16")
    nf4 = plan_json(capsys, "--lora-rank", "16", "--base-dtype", "nf4")
    print(f"mistral-7b on one H100: full fine-tune {full['dropped'][0]['reason']}; GB per device: LoRA r16 "
          f"{lora['top'][0]['memory']['total'] / 1e9:.1f}, NF4 {nf4['top'][0]['memory']['total'] / 1e9:.1f}")
    assert full["fitting"] == 0
    assert lora["top"][0]["fits"] and lora["top"][0]["memory"]["total"] <= 80e9
    assert nf4["top"][0]["fits"] and nf4["top"][0]["memory"]["total"] <= 24e9
    assert lora["command"].endswith("--lora-rank 16 --lora-targets q,k,v,o")
    assert nf4["command"].endswith("--lora-rank 16 --lora-targets q,k,v,o --base-dtype nf4")


def test_only_the_adapters_have_gradients_and_optimizer_state_and_nf4_holds_the_stack_in_its_codes():
    base = Model.named("mistral-7b")
    adapted = with_lora(base, 16, ALL, "nf4")
    layout = Layout(data=1, precision="bf16")
    memory = estimate(adapted, layout, Workload(8, 4096)).memory
    adapters = sum(leaf.size for leaf in adapted.leaves if leaf.trained)
    # every block matrix [in, out] gets r (in + out) adapter values
    c = model_config("mistral-7b")
    d, q, kv, f = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.d_ff
    assert adapters == 16 * c.n_layers * ((d + q) * 2 + (d + kv) * 2 + (d + f) * 3)
    p, g, k = state_bytes_per_param("bf16")
    assert memory["grads"] == g * adapters and memory["optimizer"] == k * adapters
    matrices = c.n_layers * (d * q * 2 + d * kv * 2 + d * f * 3)
    # the adapters at fp32, the rest of the frozen base (table, head, norms) at bf16, the matrices in NF4 codes
    assert memory["params"] == pytest.approx(p * adapters + 2 * (base.params - matrices) + (0.5 + 4 / 64) * matrices)
    plain = estimate(with_lora(base, 16, ALL), layout, Workload(8, 4096)).memory
    assert plain["params"] == pytest.approx(p * adapters + 2 * base.params)  # a bf16 base, not fp32's 4 bytes


def compiled(mesh: str, options: dict, model: str, overrides: dict, lora: dict) -> dict:
    """`jaxpar inspect --json` of one layout: an abstract compile, nothing trained."""
    from jaxpar.core.plan import Plan
    from jaxpar.run.training import TrainConfig, prepare

    config = TrainConfig(model=model, batch_size=WORK.batch_size, seq_len=WORK.seq_len, model_overrides=overrides)
    return inspection_as_users_compile(prepare(config, Plan.create(mesh, **options, **lora)))


# (mesh, options, model, overrides, base dtype): LoRA on every matrix; the arguments, the traffic and the temp within
# the 10% (the planner's own grid, tests/test_planner.py, holds the temp to 25%). The bf16 cell's temp is held
# to the grid's 25%: the planner counts bf16 activations at 2 bytes, and the compiled step keeps more than that
# (predicted / compiled 0.946 on jax 0.10, 0.890 on jax 0.12; its fp32 twin 0.955-0.985), a known planner gap.
CELLS = [
    ("data=8", {}, "tiny", {"seq_len": 32}, "none"),
    ("data=8", {"zero": 3}, "tiny", {"seq_len": 32}, "none"),
    ("data=8", {}, "tiny", QLORA_MODEL, "nf4"),
    ("data=8", {"zero": 3}, "tiny", QLORA_MODEL, "nf4"),
    ("data=8", {"precision": "bf16"}, "tiny", {"seq_len": 32}, "none"),  # the frozen base held in bf16
]


@pytest.mark.parametrize("mesh,options,model,overrides,base", CELLS, ids=["lora", "lora-zero3", "nf4", "nf4-zero3", "lora-bf16"])
def test_lora_plan_matches_the_compiled_step(mesh, options, model, overrides, base):
    lora = {"lora_rank": 4, "lora_targets": ALL, "base_dtype": base}
    sizes = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    est = estimate(with_lora(Model.named(model, overrides), 4, ALL, base), Layout(**sizes, **{"precision": "fp32", **options}),
                   WORK, "cpu")
    summary = compiled(mesh, options, model, overrides, lora)
    ratios = compare.ratios(est, summary)
    print(f"{mesh} {options} {base}: predicted / compiled {ratios}; compiled {compare.compiled_figures(summary)}")
    assert set(ratios) >= {"arguments", "temp", "traffic_data"}
    for key, ratio in ratios.items():
        tolerance = 0.25 if key == "temp" and options.get("precision") == "bf16" else 0.10
        assert abs(ratio - 1) <= tolerance, f"{key}: prediction / compiled = {ratio:.3f} (tolerance {tolerance:.0%})"

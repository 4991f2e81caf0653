"""The sorted dropless MoE kernels (`tiled`, `ragged`) equal the buffered layer under every routing option, their
choice is printed and forceable, and the tiled layer's compiled memory follows the routed rows, not experts x tokens.

The grouped FFN is checked against a per-assignment loop written here; the layer against the buffered kernel
(`moe_kernel="buffered"`, itself held to a loop over experts by test_experts.py) at 1e-6.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import max_relative_error
from test_experts import D, E, F, layer_inputs, layer_objective, plan_for
from jaxpar.core import device_facts, target
from jaxpar.core.plan import Plan
from jaxpar.parallel import expert_dispatch, expert_kernels, experts

BASE = experts.MoEConfig(E, top_k=2, dropless=True, router_z_coef=1e-3)
OPTIONS = {  # the MoE families' routing and expert options, each on the dropless layer
    "softmax-top2-zloss": BASE,
    "sigmoid-group-limited-correction": dataclasses.replace(BASE, score="sigmoid", routed_scale=2.5, n_groups=4,
                                                            topk_groups=2),
    "biased-clamped-experts": dataclasses.replace(BASE, activation="clamped", swiglu_limit=1.0),
    "llama4-input-gate": dataclasses.replace(BASE, top_k=1, sigmoid_input_gate=True),
}


@functools.cache
def option_params(option: str) -> dict:
    """The layer's parameters with the option's extra ones (biases, the correction) where it has them."""
    p = dict(layer_inputs()[0])
    keys = iter(jax.random.split(jax.random.key(7), 5))
    if option == "biased-clamped-experts":
        p["router_bias"] = jax.random.normal(next(keys), (E,))
        p["expert_gate_bias"] = jax.random.normal(next(keys), (E, F))
        p["expert_up_bias"] = jax.random.normal(next(keys), (E, F))
        p["expert_down_bias"] = jax.random.normal(next(keys), (E, D))
    if option == "sigmoid-group-limited-correction":
        p["router_correction"] = jax.random.normal(next(keys), (E,)) * 0.1
    return p


def placed_layer(option: str, mesh: str, kernel: str):
    """(plan, the objective's value-and-grad, its arguments placed on the plan) of the layer under moe_kernel=`kernel`."""
    plan = plan_for(mesh, moe_kernel=kernel)
    _, x, probe = layer_inputs()
    spec = lambda k: P() if k in experts.ROUTER_PARAMS else P(plan.rules["experts"])  # noqa: E731
    p = {k: jax.device_put(v, plan.sharding(spec(k))) for k, v in option_params(option).items()}
    x, probe = (jax.device_put(a, plan.sharding(plan.batch_spec(3))) for a in (x, probe))
    fn = jax.value_and_grad(functools.partial(layer_objective, experts.moe_ffn, OPTIONS[option]), argnums=(0, 1),
                            has_aux=True)
    return plan, fn, (p, x, probe)


@functools.cache
def run(option: str, mesh: str, kernel: str):
    """Objective, statistics and gradients (params, x) of the layer under moe_kernel=`kernel`."""
    plan, fn, args = placed_layer(option, mesh, kernel)
    with plan.activate():
        return jax.device_get(jax.jit(fn)(*args))


CASES = [(option, "data=1", "tiled") for option in OPTIONS]
CASES += [(option, "data=2,expert=4", "tiled") for option in OPTIONS]
CASES += [("softmax-top2-zloss", "data=2", "tiled"), ("softmax-top2-zloss", "data=1", "ragged"),
          ("biased-clamped-experts", "data=2,expert=4", "ragged")]


@pytest.mark.parametrize("option,mesh,kernel", CASES)
def test_sorted_kernel_equals_the_buffered_layer(option, mesh, kernel):
    (ref_value, ref_stats), ref_grads = run(option, mesh, "buffered")
    (value, stats), grads = run(option, mesh, kernel)
    assert float(stats["dropped_fraction"]) == 0.0
    assert abs(value / ref_value - 1) <= 1e-6
    assert max_relative_error(stats, ref_stats) <= 1e-6
    assert max_relative_error(grads, ref_grads) <= 1e-6
    for name, grad in grads[0].items():  # every parameter learns but the correction (it only chooses)
        assert (np.abs(grad).max() > 0) == (name != experts.CORRECTION), name


def assignment_loop(p, x, gate, expert, activation):
    """sum over a token's k choices of gate * that expert's FFN, one assignment at a time."""
    y = jnp.zeros(x.shape, jnp.float32)
    for j in range(expert.shape[1]):
        w = jax.tree.map(lambda a: a[expert[:, j]], p)
        out = jax.vmap(lambda w, row: expert_dispatch.expert_ffn(w, row[None], activation)[0])(w, x)
        y = y + gate[:, j:j + 1] * out
    return y


@pytest.mark.parametrize("form", ["tiled", "ragged"])
def test_grouped_ffn_matches_a_loop_over_assignments_with_biases(form):
    """Uneven experts (one empty, one over several tiles), biases and the clamped activation; values and the
    gradients of the weights, the rows and the gates."""
    tokens, k, d, f, n = 40, 2, 8, 6, 4
    keys = jax.random.split(jax.random.key(3), 9)
    p = {"expert_gate": jax.random.normal(keys[0], (n, d, f)), "expert_up": jax.random.normal(keys[1], (n, d, f)),
         "expert_down": jax.random.normal(keys[2], (n, f, d)), "expert_gate_bias": jax.random.normal(keys[3], (n, f)),
         "expert_up_bias": jax.random.normal(keys[4], (n, f)), "expert_down_bias": jax.random.normal(keys[5], (n, d))}
    x, probe = jax.random.normal(keys[6], (tokens, d)), jax.random.normal(keys[7], (tokens, d))
    expert = jnp.stack([jnp.where(jnp.arange(tokens) < 30, 1, 3), jnp.arange(tokens) % 2 * 3], axis=1)  # no 2
    gate = jax.nn.softmax(jax.random.normal(keys[8], (tokens, k)), axis=-1)
    activation = functools.partial(experts.gated, cfg=dataclasses.replace(BASE, activation="clamped"))

    def sorted_form(p, x, gate):
        order, weight, counts = expert_dispatch.sorted_assignments(expert, gate, n)
        return expert_dispatch.FORMS[form](p, x, order, counts, weight, activation, 8)

    results = [jax.value_and_grad(lambda *a, fn=fn: jnp.sum(fn(*a) * probe), argnums=(0, 1, 2))(p, x, gate)
               for fn in (functools.partial(assignment_loop, expert=expert, activation=activation), sorted_form)]
    (ref_value, ref_grads), (value, grads) = results
    assert abs(value / ref_value - 1) <= 1e-6
    assert max_relative_error(grads, ref_grads) <= 1e-6


def test_the_kernel_is_chosen_from_the_plans_devices_and_forced_or_refused_in_one_line():
    cpu = Plan.create("data=1", devices=jax.devices()[:1])
    assert expert_kernels.platform(cpu) == "cpu"
    assert expert_kernels.choose(True, cpu) == (
        "tiled", "auto: dropless, no native grouped matmul on XLA:CPU (ragged_dot would expand into a dense dot): "
                 "each expert's sorted rows a tile at a time")
    assert expert_kernels.choose(False, cpu)[0] == "buffered"
    forced = dataclasses.replace(cpu, moe_kernel="ragged")
    assert expert_kernels.choose(True, forced) == (
        "ragged", "asked for (moe_kernel=ragged); XLA:CPU expands ragged_dot into a dense dot over every expert")
    with pytest.raises(ValueError, match=r"^moe_kernel='tiled' runs dropless routing, but this MoE layer routes "
                                         r"with a capacity factor"):
        expert_kernels.choose(False, dataclasses.replace(cpu, moe_kernel="tiled"))
    with pytest.raises(ValueError, match=r"moe_kernel must be one of \('auto', 'buffered', 'tiled', 'ragged'\)"):
        Plan.create("data=1", devices=jax.devices()[:1], moe_kernel="grouped")


NO_TARGET = target.plugin_missing() or (None if jax.config.jax_platforms == "cpu" else "JAX_PLATFORMS is not cpu")


@pytest.mark.skipif(NO_TARGET is not None, reason=str(NO_TARGET))
def test_auto_on_an_h100_target_asks_the_targets_compiler_whether_ragged_dot_stays_grouped():
    """On a GPU the choice compiles one small ragged_dot for the plan's devices (never the process's): jax 0.12's
    XLA:GPU for h100x8 expands it into dense dots (no ragged-dot left), so auto runs `tiled` and says why; a forced
    `ragged` is run and noted."""
    plan = Plan.create("data=8", target="h100x8")
    assert expert_kernels.choose(True, plan) == (
        "tiled", "auto: dropless, no native grouped matmul on XLA:GPU (ragged_dot would expand into a dense dot): "
                 "each expert's sorted rows a tile at a time")
    facts = device_facts.of_mesh(plan.mesh)
    assert expert_kernels._GROUPED[("gpu", facts.kind, "h100x8")] is False
    assert expert_kernels.choose(True, dataclasses.replace(plan, moe_kernel="ragged")) == (
        "ragged", "asked for (moe_kernel=ragged); XLA:GPU expands ragged_dot into a dense dot over every expert")


def compiled_temp(kernel: str, n_experts: int, top_k: int, d: int, f: int, tokens: int) -> int:
    cfg = experts.MoEConfig(n_experts, top_k=top_k, dropless=True)
    shapes = {"router": (d, n_experts), "expert_gate": (n_experts, d, f), "expert_up": (n_experts, d, f),
              "expert_down": (n_experts, f, d)}
    p = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    x = jax.ShapeDtypeStruct((1, tokens, d), jnp.float32)

    def objective(p, x):
        y, stats = experts.moe_ffn(p, x, cfg)
        return jnp.sum(y * y) + stats["load_balance_loss"]

    plan = Plan.create("data=1", devices=jax.devices()[:1], moe_kernel=kernel)
    with plan.activate():
        compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(p, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_tiled_layer_memory_follows_the_routed_rows_not_experts_times_tokens():
    """E=32, k=4, d=64, f=32, 1,024 tokens (fp32): the tiled layer's forward + backward temp within 1.5x the routed
    rows' activations tokens x k x (d + f); the buffered layer keeps [E, tokens, d] buffers, E / k times more."""
    shape = dict(n_experts=32, top_k=4, d=64, f=32, tokens=1024)
    routed = shape["tokens"] * shape["top_k"] * (shape["d"] + shape["f"]) * 4
    tiled, buffered = compiled_temp("tiled", **shape), compiled_temp("buffered", **shape)
    assert tiled <= 1.5 * routed
    assert buffered > 4 * tiled


MOE_RUN = """[model]
name = "moe-tiny"
d_model = 32
head_dim = 8
n_layers = 1
moe_every = 1
expert_d_ff = 32
{extra}
[train]
steps = 2
lr = 1e-2
warmup = 1
"""


def test_cli_prints_the_moe_kernel_and_refuses_a_sorted_one_for_capacity_routing(tmp_path, capsys):
    from jaxpar.cli import main

    config = tmp_path / "moe.toml"
    flags = ["--config", str(config), "--mesh", "data=2,expert=4", "--batch-size", "8", "--seq-len", "16"]
    config.write_text(MOE_RUN.format(extra="dropless = true"))
    assert main(["train", *flags]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "moe kernel tiled (auto: dropless, no native grouped matmul on XLA:CPU" in out
    config.write_text(MOE_RUN.format(extra=""))
    assert main(["train", *flags, "--moe-kernel", "tiled"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "moe_kernel='tiled' runs dropless routing, but this MoE layer routes with a capacity factor" in err


def test_the_planner_counts_the_sorted_layer_and_fits_gpt_oss_20b_dropless_on_8_h100s():
    """Without expert parallelism a dropless layer keeps its input (d per token) and a backward workspace of the
    routed rows; over `expert` the capacity exchange's buffers (2 d per slot, E slots per token dropless), or with
    the ragged exchange its receiving buffer (expert x k rows per token) and the k rows returned. The layout
    names the kernel it was counted in."""
    from jaxpar.planner.activations import moe_mlp_values_per_token, sorted_moe_workspace
    from jaxpar.planner.layout import Layout, Workload
    from jaxpar.planner.model import Model, model_seq
    from jaxpar.planner.search import default_batch, plan

    model, seq = Model.named("gpt-oss-20b"), model_seq("gpt-oss-20b")
    assert model.dropless
    alone, over_expert = Layout(data=8), Layout(data=2, expert=4)
    assert moe_mlp_values_per_token(model, alone, seq) == model.d_model
    assert moe_mlp_values_per_token(model, over_expert, seq) == model.n_experts * (1 + 2 * model.d_model)
    assert sorted_moe_workspace(model, alone, 1000) == 1000 * (12 * (model.n_experts + model.d_model) + 16 * 4)
    assert sorted_moe_workspace(model, over_expert, 1000) == 0
    ragged = dataclasses.replace(over_expert, moe_exchange="ragged")
    assert moe_mlp_values_per_token(model, ragged, seq) == model.d_model * (1 + 4 * 4 + 4)
    assert sorted_moe_workspace(model, ragged, 1000) == 1000 * (12 * (model.n_experts + model.d_model) + 16 * 4
                                                                + 8 * 4 * 4 * model.d_model)
    best = plan(model, 8, Workload(default_batch(model, 8, seq), seq), "h100", "bf16").best
    assert best is not None and best.fits and best.layout.expert == 1
    assert best.layout.moe_kernel == "tiled" and "moe_kernel=tiled" in str(best.layout)


def test_a_forced_moe_kernel_on_a_model_without_experts_is_refused(capsys):
    from jaxpar.cli import main

    assert main(["train", "--model", "tiny", "--mesh", "data=8", "--moe-kernel", "tiled"]) == 2
    assert "moe_kernel='tiled' but tiny has no MoE layers: drop --moe-kernel" in " ".join(capsys.readouterr().err.split())

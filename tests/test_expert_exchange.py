"""The ragged exchange over `expert` (`jaxpar.parallel.expert_exchange`): each expert rank receives exactly the rows
routed to its experts. XLA:CPU has no ragged-all-to-all, so here the collective is a reference written below
(jax.lax.ragged_all_to_all's documented semantics over a padded all_to_all) and the layer around it is held to
the buffered layer at 1e-6; a GPU target's compile (the CUDA plugin) checks the real collective's bytes."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest

from helpers import max_relative_error
from test_expert_kernels import NO_TARGET, placed_layer
from test_experts import plan_for
from jaxpar.parallel import expert_exchange, experts
from jaxpar.planner import inspect
from jax.sharding import NamedSharding, PartitionSpec as P


def reference_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """Slice j of `operand` (input_offsets[j], send_sizes[j] rows) to rank j, written there at output_offsets[j]."""
    rows = operand.shape[0]
    index = input_offsets[:, None] + jnp.arange(rows)[None, :]
    sent = jnp.where((jnp.arange(rows)[None, :] < send_sizes[:, None])[..., None],
                     operand[jnp.clip(index, 0, rows - 1)], 0)
    got = jax.lax.all_to_all(sent, axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    place = jnp.where(jnp.arange(rows)[None, :] < recv_sizes[:, None], at[:, None] + jnp.arange(rows)[None, :],
                      output.shape[0])
    return output.at[place.reshape(-1)].set(got.reshape(-1, operand.shape[1]), mode="drop")


@functools.cache
def run(option: str, mesh: str, kernel: str, ragged: bool):
    plan, fn, args = placed_layer(option, mesh, kernel)
    saved = expert_exchange.RAGGED_BACKENDS, expert_exchange.ragged_all_to_all
    if ragged:
        expert_exchange.RAGGED_BACKENDS, expert_exchange.ragged_all_to_all = ("cpu",), reference_ragged_all_to_all
    try:
        with plan.activate():
            return jax.device_get(jax.jit(fn)(*args))
    finally:
        expert_exchange.RAGGED_BACKENDS, expert_exchange.ragged_all_to_all = saved


@pytest.mark.parametrize("option,mesh", [("softmax-top2-zloss", "data=2,expert=4"),
                                         ("biased-clamped-experts", "expert=8")])
def test_ragged_exchange_equals_the_buffered_layer(option, mesh):
    (ref_value, ref_stats), ref_grads = run(option, mesh, "buffered", False)
    (value, stats), grads = run(option, mesh, "tiled", True)
    assert abs(value / ref_value - 1) <= 1e-6
    assert max_relative_error(stats, ref_stats) <= 1e-6
    assert max_relative_error(grads, ref_grads) <= 1e-6


def test_the_exchange_is_chosen_from_the_plans_devices():
    plan = plan_for("data=2,expert=4")
    assert expert_exchange.choose(plan, "expert") == (
        "buffers", "XLA:CPU has no ragged-all-to-all: the capacity buffers' all-to-all")


def ragged_operand_bytes(hlo: str) -> list[int]:
    """Bytes each ragged-all-to-all sends from (XLA:GPU's async start names its operand first in its type)."""
    found = re.findall(r"=\s*\(\((f32)\[([0-9,]*)\][^\n]*ragged-all-to-all-start\(", hlo)
    return [4 * math.prod(int(n) for n in dims.split(",")) for _, dims in found]


@pytest.mark.skipif(NO_TARGET is not None, reason=str(NO_TARGET))
def test_on_an_h100_target_each_rank_is_sent_exactly_its_experts_rows():
    """Compiled for h100x8 with experts over expert=8, the layer's rows go by ragged-all-to-all: the dispatch (and
    its cotangent's) sends the routed rows, tokens x k x d x 4 bytes per device, nothing of a capacity buffer;
    the returns send from the receiving buffer (8 x those rows), of which each rank's received rows move."""
    from jaxpar.core import device_facts, gpu_profile
    from jaxpar.core.plan import Plan

    e, k, d, f, tokens = 16, 2, 32, 16, 64
    cfg = experts.MoEConfig(e, top_k=k, dropless=True)
    plan = Plan.create("expert=8", target="h100x8", moe_kernel="tiled")
    assert expert_exchange.choose(plan, "expert")[0] == "ragged"
    whole, split = NamedSharding(plan.mesh, P()), NamedSharding(plan.mesh, P("expert"))
    p = {"router": jax.ShapeDtypeStruct((d, e), jnp.float32)}
    p |= {n: jax.ShapeDtypeStruct((e, *s), jnp.float32) for n, s in
          (("expert_gate", (d, f)), ("expert_up", (d, f)), ("expert_down", (f, d)))}
    specs = {n: whole if n == "router" else split for n in p}

    def objective(p, x):
        y, stats = experts.moe_ffn(p, x, cfg)
        return jnp.sum(y * y) + stats["load_balance_loss"]

    with plan.activate():
        fn = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)), in_shardings=(specs, split),
                     out_shardings=(whole, (specs, split)))
        options = gpu_profile.compile_options(device_facts.of_mesh(plan.mesh))
        compiled, _, _ = gpu_profile.compile_with(fn.lower(p, jax.ShapeDtypeStruct((8, tokens, d), jnp.float32)),
                                                  options)
    routed = tokens * k * d * 4
    assert sorted(ragged_operand_bytes(compiled.as_text())) == [routed, routed, 8 * routed, 8 * routed]
    ragged = [op for op in inspect.collective_ops(compiled, plan.mesh) if op.kind == "ragged-all-to-all"]
    assert [(op.axes, op.bytes, op.count) for op in ragged] == [(("expert",), routed, 1)] * 4  # as jaxpar inspect reads it

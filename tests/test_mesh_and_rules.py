"""Named meshes from text, TOML and presets; logical rules resolved with divisibility checks."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar.core.mesh import AXES, MeshSpec, make_mesh, parse_mesh
from jaxpar.core.plan import Plan
from jaxpar.core.rules import DEFAULT_RULES, resolve_spec


def test_inline_mesh_fills_the_wildcard_and_keeps_every_axis():
    spec, options = parse_mesh("data=-1,tensor=2")
    mesh = make_mesh(spec)
    assert set(mesh.axis_names) == set(AXES)
    assert dict(zip(mesh.axis_names, mesh.devices.shape)) == {"replica": 1, "data": 4, "pipe": 1, "expert": 1,
                                                              "context": 1, "tensor": 2}
    assert options == {}


@pytest.mark.parametrize("form, order", [
    ("annotation", ("replica", "data", "expert", "context", "pipe", "tensor")),
    ("explicit", ("replica", "data", "expert", "context", "tensor", "pipe")),
])
def test_mesh_axes_follow_the_nesting_of_shard_maps(form, order):
    """The step's manual axes come first, then pipe and the rest in the order their shard_maps nest.

    XLA (jax 0.12) aborts on a nested shard_map whose manual axes are not sorted by mesh position.
    Reordering the names moves no device: each tensor pair stays the same two devices.
    """
    plan = Plan.create("data=2,tensor=2,pipe=2", tensor_form=form)
    assert plan.mesh.axis_names == order
    assert plan.step_manual_axes == tuple(a for a in AXES if a in ("replica", "data", "expert", "context") or
                                          (form == "explicit" and a == "tensor"))
    pairs = np.moveaxis(plan.mesh.devices, plan.mesh.axis_names.index("tensor"), -1).reshape(-1, 2)
    assert sorted(tuple(d.id for d in pair) for pair in pairs) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_context_nests_after_the_step_and_pipeline_axes():
    """Context-parallel attention nests its shard_map inside the step's (data; tensor under explicit)."""
    plan = Plan.create("data=2,context=2,tensor=2", tensor_form="explicit")
    assert plan.mesh.axis_names == ("replica", "data", "pipe", "expert", "tensor", "context")
    assert "context" not in plan.step_manual_axes
    assert Plan.create("context=2,data=4").mesh.axis_names[-1] == "context"


def test_context_is_next_to_tensor_on_the_device_grid():
    """The two axes with the most traffic per step get the nearest devices."""
    mesh = make_mesh(MeshSpec(data=2, context=2, tensor=2))
    grid = np.moveaxis(mesh.devices, [mesh.axis_names.index(a) for a in ("data", "context", "tensor")], [0, 1, 2]).reshape(2, 2, 2)
    assert [[[d.id for d in row] for row in block] for block in grid] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_sequence_rules_split_over_context_and_tensor_under_sequence_parallelism():
    shape = {"replica": 1, "data": 2, "pipe": 1, "expert": 1, "context": 2, "tensor": 2}
    rules = Plan.create("context=2,tensor=2", devices=jax.devices()[:4], sequence_parallel=True).logical_rules
    assert resolve_spec(("batch", "seq", "embed"), (4, 16, 8), shape, rules) == P("data", "context")
    assert resolve_spec(("batch", "seq_residual", "embed"), (4, 16, 8), shape, rules) == \
        P("data", ("context", "tensor"))


def test_tensor_is_the_innermost_axis():
    mesh = make_mesh(MeshSpec(data=4, tensor=2))
    ids = [[d.id for d in row] for row in mesh.devices.reshape(4, 2)]
    assert all(abs(a - b) == 1 for a, b in ids)


def test_presets_by_name_and_file(tmp_path):
    spec, options = parse_mesh("zero3-8")
    assert spec.size("data") == 8 and options == {"zero": 3}
    path = tmp_path / "m.toml"
    path.write_text("[mesh]\ndata = 2\npipe = 2\ntensor = 2\n[plan]\nzero = 1\n")
    spec, options = parse_mesh(str(path))
    assert spec == MeshSpec(data=2, pipe=2, tensor=2) and options == {"zero": 1}


@pytest.mark.parametrize(
    "text, message",
    [
        ("data=3", "has 3 devices but 8 are available"),
        ("data=4,model=2", "unknown mesh axis 'model'"),
        ("data=-1,tensor=-1", "only one mesh axis may be -1"),
        ("data=-1,tensor=3", "do not divide by the product 3"),
        ("no-such-preset", "unknown mesh 'no-such-preset'"),
    ],
)
def test_bad_meshes_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(parse_mesh(text)[0])


def test_unknown_keys_in_a_preset_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[mesh]\ndata = 8\n[plans]\nzero = 1\n")
    with pytest.raises(ValueError, match=r"unknown top-level keys \['plans'\]"):
        parse_mesh(str(path))
    path.write_text("[mesh]\ndata = 8\n[plan]\nzeroo = 1\n")
    with pytest.raises(ValueError, match=r"unknown plan options \['zeroo'\]"):
        Plan.create(str(path))


def test_resolution_drops_trivial_axes_and_never_reuses_one():
    shape = {"replica": 1, "data": 4, "pipe": 1, "expert": 2, "context": 1, "tensor": 1}
    assert resolve_spec(("batch", "seq"), (16, 8), shape, DEFAULT_RULES) == P(("data", "expert"))
    rules = {**DEFAULT_RULES, "embed": "data"}
    assert resolve_spec(("batch", "embed"), (16, 8), shape, rules) == P(("data", "expert"))


def test_resolution_error_names_path_dimension_size_and_axes():
    shape = {"replica": 1, "data": 2, "pipe": 1, "expert": 1, "context": 1, "tensor": 4}
    with pytest.raises(ValueError) as error:
        resolve_spec(("layers", "embed", "kv_heads", "head_dim"), (4, 64, 3, 16), shape, DEFAULT_RULES, path="blocks.wk")
    text = str(error.value)
    assert "blocks.wk" in text and "dimension 2" in text and "'kv_heads'" in text
    assert "size 3" in text and "tensor=4" in text and "nor is it a divisor of 4" in text


def test_batch_that_does_not_divide():
    with pytest.raises(ValueError, match=r"global batch 12 does not divide by the batch axes data=8"):
        Plan.create("data=8").check_batch(12)


def test_device_count_matches_conftest():
    assert jax.device_count() == 8

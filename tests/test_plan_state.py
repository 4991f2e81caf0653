"""The plan's state is explicit: given options checked as given, derivations as properties, one active-plan context."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jaxpar.core import trace as context
from jaxpar.core.mesh import AXES, MeshSpec
from jaxpar.core.plan import Plan
from jaxpar.parallel import constrain


def test_replace_derives_the_rules_again():
    """Turning sequence parallelism off in a copy drops its rule (it is derived, never stored)."""
    sp = Plan.create("data=4,tensor=2", sequence_parallel=True)
    assert sp.logical_rules["seq_residual"] == ("context", "tensor") and sp.rules["seq_residual"] == "context"
    assert dataclasses.replace(sp, sequence_parallel=False).logical_rules["seq_residual"] == "context"


def test_create_converts_and_the_constructor_checks():
    plan = Plan.create("pipe=4,data=2")
    assert plan.microbatches == 0 and plan.pipeline_microbatches == 4  # 0: one per stage, derived
    assert dataclasses.replace(plan, mesh=Plan.create("pipe=2,data=4").mesh).pipeline_microbatches == 2
    with pytest.raises(ValueError, match="microbatches must be >= 1, or 0 for one per pipe stage; got -1"):
        Plan(mesh=plan.mesh, microbatches=-1)
    grid = np.array(jax.devices()).reshape(1, 1, 1, 2, 4, 1)
    backwards = Mesh(grid, ("expert", "pipe", "context", "tensor", "data", "replica"), axis_types=(AxisType.Auto,) * 6)
    with pytest.raises(ValueError, match="must nest as .* build the plan with Plan.create"):
        Plan(mesh=backwards)
    assert Plan.create(backwards).mesh.axis_names[:2] == ("replica", "data")


def test_mesh_axes_are_data():
    spec = MeshSpec(tensor=2, data=-1)
    assert spec.shape == {**{a: 1 for a in AXES}, "tensor": 2, "data": -1}
    assert spec.resolve(8) == MeshSpec(data=4, tensor=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        MeshSpec(model=2)


def test_one_active_plan_context():
    plan = Plan.create("data=4,tensor=2", rules={"hidden": "tensor"})
    assert context.active_plan() is None and constrain.rule_axes("hidden") == ()
    with plan.activate():
        assert context.active_plan() is plan and constrain.rule_axes("hidden") == ("tensor",)
        assert jax.sharding.get_abstract_mesh().axis_names == plan.mesh.axis_names
    assert context.active_plan() is None

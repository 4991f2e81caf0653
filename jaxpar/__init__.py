"""jaxpar: one Flax model, any mesh. Data, ZeRO/FSDP, tensor, pipeline and expert parallelism in JAX."""

from jaxpar.mesh import AXES, MeshSpec, make_mesh, parse_mesh
from jaxpar.plan import Plan
from jaxpar.rules import DEFAULT_RULES, constrain
from jaxpar.state import TrainState, describe, init_state, place_state
from jaxpar.step import make_train_step

__all__ = [
    "AXES", "DEFAULT_RULES", "MeshSpec", "Plan", "TrainState", "constrain", "describe", "init_state",
    "make_mesh", "make_train_step", "parse_mesh", "place_state",
]

"""jaxpar: one Flax model, any mesh. Data, ZeRO/FSDP, tensor, pipeline and expert parallelism in JAX."""

from pathlib import Path as _Path

# models/ and meshes/ sit at the top of a source checkout and ship as jaxpar.models and jaxpar.meshes
# (pyproject's package-dir); run from the checkout itself (`python -m pytest`), the package path reaches them.
_root = _Path(__file__).resolve().parent.parent
if not (_root / "jaxpar" / "models").exists() and (_root / "models" / "__init__.py").is_file():
    __path__.append(str(_root))
del _Path, _root

from jaxpar.core import compile_cache, gpu_profile
from jaxpar.core.mesh import AXES, MeshSpec, make_mesh, parse_mesh
from jaxpar.core.plan import Plan
from jaxpar.core.rules import DEFAULT_RULES, LogicalArray
from jaxpar.core.trace import active_plan
from jaxpar.core.usage import PlanOptionUnused
from jaxpar.data.stream import BatchStream, DataSpec, batch_stream

# Each strategy registers its plan options' choices and checks when imported (jaxpar.core.options): all of
# them are imported here, so that any Plan made after `import jaxpar` is checked by every one.
from jaxpar.parallel import offload as _offload  # noqa: F401

# Building blocks for a model of one's own: stacked layers, Megatron layers, the MoE layer, the pipeline.
from jaxpar.parallel.attention import causal_attention
from jaxpar.parallel.attention import positions as token_positions
from jaxpar.parallel.constrain import constrain
from jaxpar.parallel.experts import MoEConfig, moe_ffn
from jaxpar.parallel import lora  # LoRA adapters on a model's weights: jaxpar.lora.apply(model, rank, ...)
from jaxpar import objectives  # preference objectives (DPO, SimPO, ORPO) as a step's loss_fn: jaxpar.objectives.make
from jaxpar.parallel.stack import Stack, scan_layers
from jaxpar.parallel.tensor import (
    column_parallel,
    embedding_lookup,
    enter_tensor_region,
    row_parallel,
    vocab_parallel_cross_entropy,
)
from jaxpar.pipeline import schedule as _schedule  # noqa: F401
from jaxpar.pipeline.executor import Stages
from jaxpar.pipeline.executor import loss as pipeline_loss
from jaxpar.pipeline.layer_order import (
    state_to_natural_order,
    state_to_pipeline_order,
    to_natural_order,
    to_pipeline_order,
)
from jaxpar.pipeline.pipelined_loss import pipelined_loss
from jaxpar.run.sample import sample  # completions drawn on a training plan (GRPO's, or one's own loop)
from jaxpar.train import precision as _precision  # noqa: F401
from jaxpar.train.state import TrainState, describe, init_state, place_state
from jaxpar.train.step import make_train_step

# The modules of one's own training loop, stable names whatever moves beneath them: imported on first use
# (`import jaxpar; jaxpar.checkpoint.Checkpoints`), so that `import jaxpar` stays free of Orbax and TensorBoard.
PUBLIC_MODULES = ("checkpoint", "distributed", "inspect", "metrics", "objectives")


def __getattr__(name: str):
    if name in PUBLIC_MODULES:
        import importlib

        return importlib.import_module(f"jaxpar.{name}")
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")


compile_cache.use_default()  # compiled steps kept across runs (jaxpar.compile_cache.use(DIR | "off") to change)

__all__ = [
    "AXES", "BatchStream", "DEFAULT_RULES", "DataSpec", "LogicalArray", "MeshSpec", "MoEConfig", "Plan",
    "PlanOptionUnused", "Stack", "Stages", "TrainState", "active_plan", "batch_stream", "causal_attention",
    "column_parallel", "compile_cache", "constrain", "describe", "embedding_lookup", "enter_tensor_region", "gpu_profile",
    "init_state", "lora", "make_mesh", "make_train_step", "moe_ffn", "objectives", "parse_mesh", "pipeline_loss",
    "pipelined_loss",
    "place_state", "row_parallel", "sample", "scan_layers", "state_to_natural_order", "state_to_pipeline_order",
    "to_natural_order", "to_pipeline_order", "token_positions", "vocab_parallel_cross_entropy",
]

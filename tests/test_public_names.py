"""The names a user may rely on: every one listed here, and a test that fails when one disappears.

A script written against these names keeps working however the package is reorganised beneath them
(`jaxpar.checkpoint.Checkpoints` stays where it is when `jaxpar.train.checkpoint` moves). Removing a name
is a breaking change: this list changes with it, deliberately. A new public name is added here too, so that
the list stays the whole promise (the second test says which are missing).
"""

import importlib

import pytest

import jaxpar

PUBLIC = {
    "jaxpar": [
        "AXES", "BatchStream", "DataSpec", "DEFAULT_RULES", "LogicalArray", "MeshSpec", "MoEConfig", "Plan", "PlanOptionUnused", "Stack",
        "Stages", "TrainState", "active_plan", "batch_stream", "causal_attention", "column_parallel", "compile_cache", "constrain",
        "describe",
        "embedding_lookup", "enter_tensor_region", "gpu_profile", "init_state", "lora", "make_mesh", "make_train_step",
        "moe_ffn", "objectives", "parse_mesh", "pipeline_loss", "pipelined_loss", "place_state", "row_parallel", "sample", "scan_layers",
        "state_to_natural_order", "state_to_pipeline_order", "to_natural_order", "to_pipeline_order",
        "token_positions", "vocab_parallel_cross_entropy",
    ],
    "jaxpar.checkpoint": ["Checkpoints", "CorruptCheckpoint"],
    "jaxpar.distributed": ["heartbeat", "initialize", "is_leader"],
    "jaxpar.inspect": ["abstract_state", "collectives", "flops", "inspect_step", "matmul_flops", "memory", "show",
                       "summary"],
    "jaxpar.objectives": ["OBJECTIVES", "Preference", "REFERENCE", "SIDES", "adapters_off", "answer_sums", "dpo_loss",
                          "grpo_loss", "make", "orpo_loss", "reducing", "reference_logps", "register", "simpo_loss"],
    "jaxpar.metrics": ["Metrics", "Mfu", "device_memory", "mfu", "model_flops_per_step", "progress_line"],
}
# The faces of the public objects: the methods a loop calls.
METHODS = {
    ("jaxpar.checkpoint", "Checkpoints"): ["save", "restore", "latest_step", "all_steps", "reached_preemption",
                                           "metadata", "wait_until_finished", "close", "__enter__", "__exit__"],
    ("jaxpar.metrics", "Metrics"): ["write", "close", "__enter__", "__exit__"],
}
# The built-in models as building blocks (jaxpar.models has no __all__: these must stay importable).
MODELS = {
    "jaxpar.models": ["Llama", "LlamaConfig", "MoeLlama", "DeepseekV3", "MODELS", "model_config", "model_factory"],
    "jaxpar.models.llama": ["Llama", "LlamaConfig", "CONFIGS"],
    "jaxpar.models.inference": ["init_cache"],
    "jaxpar.models.moe": ["MoeLlama", "MoeLlamaConfig", "CONFIGS"],
    "jaxpar.models.deepseek": ["DeepseekV3", "DeepseekConfig", "CONFIGS"],
    "jaxpar.models.latent_cache": ["init_cache"],
}


@pytest.mark.parametrize("module", sorted({**PUBLIC, **MODELS}))
def test_no_public_name_disappears(module):
    found = importlib.import_module(module)
    names = {**PUBLIC, **MODELS}[module]
    gone = [name for name in names if not hasattr(found, name)]
    assert not gone, f"{module} lost public names {gone}: scripts using them break"
    if module in PUBLIC:
        unlisted = sorted(set(names) - set(found.__all__))
        assert not unlisted, f"{module}.__all__ no longer lists {unlisted}"


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_is_on_the_list(module):
    extra = sorted(set(importlib.import_module(module).__all__) - set(PUBLIC[module]))
    assert not extra, f"{module}.__all__ has {extra}, not on tests/test_public_names.py's list: add them there"


def test_the_public_modules_are_the_listed_ones_and_reachable_from_jaxpar():
    assert sorted(f"jaxpar.{m}" for m in jaxpar.PUBLIC_MODULES) == sorted(set(PUBLIC) - {"jaxpar"})
    for name in jaxpar.PUBLIC_MODULES:
        assert getattr(jaxpar, name) is importlib.import_module(f"jaxpar.{name}")


@pytest.mark.parametrize("owner", sorted(METHODS))
def test_the_public_objects_keep_their_methods(owner):
    cls = getattr(importlib.import_module(owner[0]), owner[1])
    gone = [name for name in METHODS[owner] if not callable(getattr(cls, name, None))]
    assert not gone, f"{owner[0]}.{owner[1]} lost methods {gone}"


# jaxpar.lora: what a loop of one's own calls to put adapters on its model and to fold them back in
LORA = ["apply", "merged", "TRAINABLE"]


def test_lora_keeps_its_calls():
    gone = [name for name in LORA if not hasattr(jaxpar.lora, name)]
    assert not gone, f"jaxpar.lora lost {gone}: scripts using them break"


"""Force 8 CPU devices before jax is imported, so every strategy is tested on one machine."""

import os

# The tests check layouts, collectives, memory and numbers, not the speed of generated code, and
# XLA:CPU spends about half of each compile in LLVM's optimisation passes. Level 0 skips them: the
# compiled HLO, its collectives and memory_analysis are the same, compiles take half the time.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

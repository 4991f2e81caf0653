"""Force 8 CPU devices before jax is imported, so every strategy is tested on one machine; keep compiled programs in
one persistent cache for the whole run."""

import os
import shutil
import subprocess
import sys
import tempfile

# The tests check layouts, collectives, memory and numbers, not the speed of generated code, and
# XLA:CPU spends about half of each compile in LLVM's optimisation passes. Level 0 skips them: the
# compiled HLO, its collectives and memory_analysis are the same, compiles take half the time.
OPTIMIZATION_LEVEL_0 = "--xla_backend_optimization_level=0"
# Older XLA:CPU (jaxlib 0.10) also has its classic elemental emitters beside the MLIR fusion emitters; at the
# tests' sizes they compile the same fusions in about 55% of the CPU time. Their buffer assignment can differ, so
# where the planner is held against what a user's XLA:CPU compiles, the test compiles with the default emitters
# (helpers.inspection_as_users_compile). Newer XLA has only the fusion emitters and aborts on the unknown flag, so
# one probe per test session (inherited by workers and subprocesses through the environment) decides.
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
PROBED = "JAXPAR_TEST_FAST_COMPILE"


def fast_compile_flags() -> str:
    if PROBED not in os.environ:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                               env={**os.environ, "XLA_FLAGS": CLASSIC_EMITTERS, "JAX_PLATFORMS": "cpu"},
                               capture_output=True)
        classic = [CLASSIC_EMITTERS] if probe.returncode == 0 else []
        os.environ[PROBED] = " ".join([OPTIMIZATION_LEVEL_0, *classic])
    return os.environ[PROBED]


FAST_COMPILE = fast_compile_flags()
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Many test files and the processes they start compile the same small steps. One compile cache for the whole run
# (every xdist worker and every subprocess inherits the directory; jaxpar.core.compile_cache reads it) loads a step
# that another test already compiled. .ci/run gives a fresh directory, so CI pays what a fresh machine pays;
# without one the session makes its own and removes it at the end. Tests compile small programs: a lower threshold
# than jaxpar's 0.5 s keeps them too.
CACHE_ENV = "JAXPAR_COMPILE_CACHE"
SESSION_CACHE = None
if CACHE_ENV not in os.environ:
    SESSION_CACHE = os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="jaxpar-test-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_sessionfinish(session):
    if SESSION_CACHE is not None and not hasattr(session.config, "workerinput"):  # the controller made it
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)

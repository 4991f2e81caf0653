"""Multi-process start-up: one process per host (or per GPU), joined by jax.distributed.

On a cluster (SLURM, Open MPI, Kubernetes/TPU) `jax.distributed.initialize()`
finds the coordinator itself; elsewhere set JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. `launch_local` starts N such processes
on this machine (each with its own host devices), which is how the
multi-process path is exercised without a cluster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES")


def initialize() -> bool:
    """Join the multi-process runtime when launched as part of one; True if it did."""
    if not any(name in os.environ for name in CLUSTER_ENV):
        return False
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") and "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True


def is_leader() -> bool:
    """True on the process that prints and writes files (process 0)."""
    import jax

    return jax.process_index() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_local(num_processes: int, devices_per_process: int, argv: list[str]) -> int:
    """Run `jaxpar <argv>` as `num_processes` cooperating processes on this machine.

    Only process 0's output is shown; the exit code is the first non-zero one.
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"launch needs processes >= 1 and devices per process >= 1, got {num_processes}, {devices_per_process}")
    address = f"localhost:{_free_port()}"
    children = []
    for rank in range(num_processes):
        env = {
            **os.environ,
            "JAX_COORDINATOR_ADDRESS": address,
            "JAX_NUM_PROCESSES": str(num_processes),
            "JAX_PROCESS_ID": str(rank),
        }
        command = [sys.executable, "-m", "jaxpar.cli", *argv, "--devices", str(devices_per_process)]
        quiet = subprocess.DEVNULL if rank else None
        children.append(subprocess.Popen(command, env=env, stdout=quiet, stderr=quiet))
    return _wait_all(children)


def describe_exit(rank: int, code: int) -> str:
    """One line naming the rank and how it ended, so a user sees which process took the job down."""
    if code < 0:
        import signal

        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


def _wait_all(children: list[subprocess.Popen]) -> int:
    """Wait for every process; when one fails, say which and stop the others (they would wait for it forever)."""
    while True:
        codes = [child.poll() for child in children]
        failed_rank = next((rank for rank, code in enumerate(codes) if code), None)
        if failed_rank is not None or all(code is not None for code in codes):
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            if failed_rank is None:
                return 0
            code = codes[failed_rank]
            print(f"jaxpar launch: {describe_exit(failed_rank, code)}; stopped the other ranks", file=sys.stderr)
            return code if code > 0 else 128 - code
        time.sleep(0.2)

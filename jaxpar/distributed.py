"""Multi-process start-up: one process per host (or per GPU), joined by jax.distributed.

On a cluster (SLURM, Open MPI, Kubernetes/TPU) `jax.distributed.initialize()`
finds the coordinator itself; elsewhere set JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. A single process needs nothing.
"""

from __future__ import annotations

import os

import jax

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES")


def initialize() -> bool:
    """Join the multi-process runtime when launched as part of one; True if it did."""
    if not any(name in os.environ for name in CLUSTER_ENV):
        return False
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True

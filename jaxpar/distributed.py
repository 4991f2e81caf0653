"""Several processes as one job, for a training loop of one's own (a stable public name).

    import jaxpar.distributed
    jaxpar.distributed.initialize()   # first, before anything else uses jax

`initialize()` joins the job it was started in: `jaxpar launch -n N -- python my_train.py` (its environment:
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), Slurm's `srun`, Open MPI, or a TPU pod, through
jax's own cluster detection; run alone it does nothing and returns False. `is_leader()` is the process that
prints and writes files. `heartbeat(step)` tells `jaxpar launch` each completed step (`jaxpar.checkpoint`'s
`Checkpoints.save` does it), so a death report names the last step and `--heartbeat-s` catches a hang.
"""

from jaxpar.train.distributed import heartbeat, initialize, is_leader

__all__ = ["heartbeat", "initialize", "is_leader"]

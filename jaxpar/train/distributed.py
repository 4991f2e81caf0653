"""Multi-process start-up: one process per host (or per GPU), joined by jax.distributed.

On a cluster (SLURM, Open MPI, Kubernetes/TPU) `jax.distributed.initialize()`
finds the coordinator itself; elsewhere set JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID. `launch_local` starts N such processes
on this machine (each with its own host devices), which is how the
multi-process path is exercised without a cluster.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

from jaxpar.core.timeline import mark
from jaxpar.train.rank_report import CLUSTER_ENV, heartbeat, show_life, watch_exit  # noqa: F401 (heartbeat: public)

LOST_RANKS_ENV = "JAXPAR_TEST_LOST_RANKS"  # a test hook: these ranks of the first start, once dead, never come back
PREEMPTED_MARKER = "PREEMPTED"  # written into --checkpoint-dir by a preemption save; the Slurm recipe requeues on it


GOOGLE_PCI_VENDOR = "0x1ae0"  # a Cloud TPU VM's chips; its pod is found by jax through the metadata server


def _on_cloud_tpu() -> bool:
    """True on a Cloud TPU VM (its TPU chips on the PCI bus), where jax finds the pod's other hosts itself."""
    return any(path.read_text().strip() == GOOGLE_PCI_VENDOR for path in Path("/sys/bus/pci/devices").glob("*/vendor"))


def initialize() -> bool:
    """Join the multi-process runtime when launched as part of one; True if it did (or had already).

    The job is read from `jaxpar launch`'s environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID), else found by jax's own cluster detection: Slurm, Open MPI, a TPU pod (GKE's
    TPU_WORKER_HOSTNAMES, or a Cloud TPU VM's metadata). Call it before anything else uses jax.
    A coordinator port that cannot be bound is a ValueError of one line (the port and how to choose another),
    not jax's traceback: the rank exits 2 and the others end with it (`jaxpar launch`, srun --kill-on-bad-exit).
    Once joined, a non-zero exit (an uncaught exception, `sys.exit(n)`) ends the process at once with its code
    (rank_report.watch_exit): its peers, waiting in a collective, would keep it in jax's shutdown barrier."""
    import jax

    if jax.distributed.is_initialized():
        return True
    if not any(name in os.environ for name in CLUSTER_ENV) and not _on_cloud_tpu():
        return False
    show_life()

    if jax.config.jax_platforms in (None, "", "cpu") and "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    check_port(_coordinator_port())
    try:
        if "JAX_COORDINATOR_ADDRESS" in os.environ:
            jax.distributed.initialize(
                coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                process_id=int(os.environ["JAX_PROCESS_ID"]),
            )
        else:
            jax.distributed.initialize()
    except jax.errors.JaxRuntimeError as error:
        if "Failed to start RPC server" not in str(error):
            raise
        from jax._src.distributed import global_state  # the address jax chose (Slurm: from the job id)

        raise ValueError(_port_in_use(str(global_state.coordinator_address).rsplit(":", 1)[-1])) from None
    watch_exit()  # an error from here on ends this rank at once with its code, not in jax's shutdown barrier
    mark("distributed initialized")
    return True


def _coordinator_port() -> int | None:
    """The port this process will serve the coordinator on, when it is the coordinator and the port is known ahead."""
    if "JAX_COORDINATOR_ADDRESS" in os.environ and os.environ.get("JAX_PROCESS_ID") == "0":
        return int(os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    if "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_PROCID") == "0":  # jax's rule (clusters/slurm_cluster.py)
        return int(os.environ.get("JAX_COORDINATOR_PORT") or int(os.environ["SLURM_JOB_ID"]) % 4096 + 61440)
    return None


def _port_in_use(port) -> str:
    return (f"coordinator port {port} is in use (another job on this node?): choose another with "
            f"`jaxpar launch --coordinator-port N` or JAX_COORDINATOR_PORT=N")


def check_port(port: int | None) -> None:
    """ValueError naming `port` if it cannot be bound here (as jax's coordinator binds it: every address)."""
    if port is None:
        return
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            probe.bind(("::" if probe.family == socket.AF_INET6 else "", port))
        except OSError:
            raise ValueError(_port_in_use(port)) from None


def is_leader() -> bool:
    """True on the process that prints and writes files (process 0)."""
    import jax

    return jax.process_index() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def shrink_command(num_processes: int, argv: list[str], left: int, min_processes: int | None) -> list[str]:
    """The process count and the `jaxpar` command to run on `left` of the `num_processes` the command was written
    for: the command itself when all are there, else its shrunk layout (launcher.shrink_to, as an elastic restart).
    For job scripts whose allocation may come back smaller (the Slurm recipe's `--nodes=MIN-MAX`); ValueError why not.
    """
    from jaxpar.train import launcher

    if min_processes is None or not 1 <= min_processes <= num_processes:
        raise ValueError(f"--shrink-to needs --min-processes between 1 and -n {num_processes}")
    if any("\n" in arg for arg in argv):
        raise ValueError("--shrink-to prints one argument a line: an argument holds a newline")
    if left >= num_processes:
        return [str(num_processes), *argv]
    try:
        n, shrunk_argv, change = launcher.shrink_to(argv, num_processes, left, min_processes)
    except ValueError as error:
        raise ValueError(f"the job cannot shrink from {num_processes} processes: {error}") from None
    print(f"jaxpar launch: {left} of {num_processes} processes; shrinking: {change}", file=sys.stderr, flush=True)
    return [str(n), *shrunk_argv]


def host_devices_env(env: dict, count: int) -> dict:
    """`env` with XLA_FLAGS exposing `count` host (CPU) devices, whatever count it named before."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    return {**env, "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])}


@dataclasses.dataclass
class LaunchOptions:
    """What `jaxpar launch` runs and how (launch_local), checked as a whole before anything starts.

    `argv`: `jaxpar <argv>`, or with `any_command` a command of its own (`python my_train.py ...`), run as it is;
    each rank finds the job in its environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
    `initialize` reads them) and `devices_per_process` host devices in XLA_FLAGS. Its restarts are its own to
    resume, and it tells its steps and checkpoint directory through `jaxpar.checkpoint` or `heartbeat`.
    `log_dir`: every rank's stdout/stderr (default `<checkpoint-dir>/logs` when the command has a
    --checkpoint-dir). `resume`: the command line printed as the way to resume after a death. `max_restarts`:
    deaths followed by a restart. `heartbeat_s`: no step for that long (after the first; before it, no sign of
    life) ends the job as a death, naming the hung rank (None: 10x the slowest step seen, at least 60 s; 0: off).
    `coordinator_port`: rank 0's port (default JAX_COORDINATOR_PORT, else a free one). `min_processes`: a rank
    that cannot come back (on one machine only by the test hook LOST_RANKS_ENV) restarts the job on fewer
    processes, down to this, with a smaller data axis and more gradient accumulation (launcher.shrunk).
    """

    num_processes: int
    devices_per_process: int
    argv: list[str]
    grace_s: float = 30.0
    log_dir: str | None = None
    max_restarts: int = 0
    resume: list[str] = ()
    heartbeat_s: float | None = None
    coordinator_port: int | None = None
    min_processes: int | None = None
    any_command: bool = False

    def __post_init__(self):
        import shutil

        from jaxpar.train import launcher

        self.argv, self.resume = list(self.argv), list(self.resume)
        n = self.num_processes
        if n < 1 or self.devices_per_process < 1:
            raise ValueError(f"launch needs processes >= 1 and devices per process >= 1, got {n}, "
                             f"{self.devices_per_process}")
        if not self.argv:
            raise ValueError("launch needs a command: `jaxpar launch -n 2 -- python my_train.py` or "
                             "`... train --mesh ...`")
        for name, value in (("--grace-s", self.grace_s), ("--max-restarts", self.max_restarts)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.heartbeat_s is not None and self.heartbeat_s < 0:
            raise ValueError(f"--heartbeat-s must be >= 0 (0: off), got {self.heartbeat_s}")
        self.checkpoint_dir = launcher.checkpoint_dir_of(self.argv)
        if self.max_restarts and self.checkpoint_dir is None and not self.any_command:
            raise ValueError("--max-restarts needs --checkpoint-dir in the command: a restart resumes from it")
        if self.any_command and shutil.which(self.argv[0]) is None:
            raise ValueError(f"launch: command {self.argv[0]!r} not found (neither on PATH nor an executable file)")
        if self.any_command and self.min_processes is not None:
            raise ValueError(f"--min-processes shrinks a `jaxpar train` layout; {self.argv[0]!r} is a command of its "
                             "own")
        if self.min_processes is not None and not 1 <= self.min_processes <= n:
            raise ValueError(f"--min-processes must be between 1 and -n {n}, got {self.min_processes}")
        if self.min_processes is not None and not self.max_restarts:
            raise ValueError("--min-processes needs --max-restarts: the job restarts on the processes left")
        if self.coordinator_port is None and os.environ.get("JAX_COORDINATOR_PORT"):
            self.coordinator_port = _port_of(os.environ["JAX_COORDINATOR_PORT"])
        check_port(self.coordinator_port)
        if self.log_dir is None and self.checkpoint_dir is not None:
            self.log_dir = str(Path(self.checkpoint_dir) / "logs")


def _port_of(text: str) -> int:
    """JAX_COORDINATOR_PORT as a port number, or a ValueError naming it."""
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"JAX_COORDINATOR_PORT={text!r} is not a port number (1-65535)")
    return int(text)


def launch_local(num_processes: int, devices_per_process: int, argv: list[str], **options) -> int:
    """Run `jaxpar <argv>` (or a command of its own) as `num_processes` cooperating processes on this machine,
    supervised (train/launcher.py); `options` are LaunchOptions' (checked there, before anything starts).

    Every rank writes its step to `<log-dir>/rankN.beat` (a temporary directory without one, which also keeps the
    output of ranks other than 0 for the report): the launcher's exact "last step", and how it tells a
    configuration error (exit 2 before any step) from a death.
    """
    import shutil
    import tempfile

    from jaxpar.train import launcher

    job = LaunchOptions(num_processes, devices_per_process, argv, **options)
    log_dir = None if job.log_dir is None else Path(job.log_dir)
    beat_dir = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="jaxpar-beats-"))
    now = {"processes": num_processes, "argv": job.argv}  # what the next (re)start runs: a shrink changes it
    lost = {int(r) for r in os.environ.get(LOST_RANKS_ENV, "").split(",") if r}
    spares = launcher.Spares(job.max_restarts) if job.max_restarts and not job.any_command else None

    def start_ranks() -> list:
        address = f"localhost:{job.coordinator_port or _free_port()}"  # a fresh coordinator for every (re)start
        n = now["processes"]
        if job.any_command:
            command, env = now["argv"], host_devices_env(dict(os.environ), devices_per_process)
        else:
            command = [sys.executable, "-m", "jaxpar.cli", *now["argv"], "--devices", str(devices_per_process)]
            env = os.environ
        envs = [{**env, "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(n),
                 "JAX_PROCESS_ID": str(rank)} for rank in range(n)]
        return launcher.start([command] * n, envs, log_dir, beat_dir, spares)

    def shrink(left: int) -> str | None:
        """The largest count from `left` down to min_processes that the layout shrinks to; None without the option."""
        if job.min_processes is None:
            return None
        now["processes"], now["argv"], change = launcher.shrink_to(job.argv, num_processes, left, job.min_processes)
        return change

    try:
        return launcher.run(start_ranks, max_restarts=job.max_restarts, grace_s=job.grace_s,
                            checkpoint_dir=job.checkpoint_dir, resume=job.resume, heartbeat_s=job.heartbeat_s,
                            events=None if log_dir is None else log_dir / "events.jsonl",
                            lost=lambda rank: now["processes"] == num_processes and rank in lost, shrink=shrink)
    finally:
        if spares is not None:
            spares.close()
        if log_dir is None:
            shutil.rmtree(beat_dir, ignore_errors=True)  # the temporary heartbeats and logs

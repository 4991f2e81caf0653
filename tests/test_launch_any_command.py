"""`jaxpar launch -n 2 -- python my_train.py`: a script of one's own as cooperating processes.

The script joins the job with `jaxpar.distributed.initialize()` and sums across the two processes; a rank that
dies is reported as a `jaxpar train` rank is (who, how, its last step, the others ended, the resume command).
"""

import os
import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import jaxpar.distributed

    assert jaxpar.distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    mine = np.full((jax.local_device_count(),), jax.process_index() + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), mine)
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(jnp.sum(a), "data"), mesh=mesh, in_specs=P("data"),
                                  out_specs=P()))(x)
    print(f"rank {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} devices, "
          f"psum {float(total):g}", flush=True)
    jaxpar.distributed.heartbeat(3)
    if sys.argv[1] == "die" and jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "die":
        time.sleep(60)  # rank 0 would wait for its dead peer; the launcher ends it
""")


def _launch(tmp_path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "2",
               "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script), mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_a_script_of_ones_own_runs_as_two_processes_and_sums_across_them(tmp_path):
    done = _launch(tmp_path, "sum")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 of 2: 2 devices, psum 6" in done.stdout  # (1 + 1) + (2 + 2): two devices in each process
    assert "rank 1 of 2: 2 devices, psum 6" in (tmp_path / "logs" / "rank1.out").read_text()
    assert "rank 1" not in done.stdout  # rank 1 to its log only


def test_a_killed_rank_of_a_script_is_reported_as_for_jaxpar_train(tmp_path):
    done = _launch(tmp_path, "die")
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("jaxpar launch: rank 1"):]
    assert "rank 1 was killed by SIGKILL" in report
    assert "last step it completed:   3" in report
    assert "last complete checkpoint: none (no --checkpoint-dir: the run cannot resume)" in report
    assert "SIGKILLed 1 s after SIGTERM: [0]" in report or "rank 0 was killed by SIGTERM" in report
    assert "no process of the job remains" in report
    assert f"resume with:              jaxpar launch -n 2 --devices-per-process 2 --log-dir {tmp_path / 'logs'} -- " \
           f"{sys.executable} {tmp_path / 'my_train.py'} die" in report


def test_a_command_that_does_not_exist_is_one_line():
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--", "no-such-command-x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: launch: command 'no-such-command-x' not found (neither on PATH nor "
                                        "an executable file)"]

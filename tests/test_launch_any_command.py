"""`jaxpar launch -n 2 -- python my_train.py`: a script of one's own as cooperating processes.

The script joins the job with `jaxpar.distributed.initialize()` and sums across the two processes; a rank that
dies is reported as a `jaxpar train` rank is (who, how, its last step, the others ended, the resume command).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

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
    first_try = not os.path.exists(sys.argv[2])
    if jax.process_index() == 1 and (sys.argv[1] == "die" or (sys.argv[1] == "die-once" and first_try)):
        open(sys.argv[2], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "die":
        time.sleep(60)  # rank 0 would wait for its dead peer; the launcher ends it
""")

# A loop of one's own with jaxpar.checkpoint, stepping until a preemption notice, which every rank must agree on.
LOOP = textwrap.dedent("""
    import sys, time
    import jaxpar.distributed

    jaxpar.distributed.initialize()
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpar
    from jaxpar.checkpoint import Checkpoints

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(4, 4, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                        ("embed", "mlp")), rngs=rngs)

        def __call__(self, x):
            return self.w(x)

    plan = jaxpar.Plan.create(f"data={jax.device_count()}")
    optimizer = optax.sgd(0.1)
    model, state = jaxpar.init_state(lambda: Linear(nnx.Rngs(0)), optimizer, plan)
    train_step = jaxpar.make_train_step(model, lambda m, b: np.float32(0.5) * ((m(b["x"]) - b["x"]) ** 2).mean(),
                                        optimizer, plan)
    rows = np.ones((2 * jax.local_device_count(), 4), np.float32)
    x = jax.make_array_from_process_local_data(plan.sharding(plan.batch_spec(2)), rows)
    with Checkpoints(sys.argv[1], model, optimizer, plan, save_every=1000) as checkpoints:
        for step in range(1000):
            state, metrics = train_step(state, {"x": x})
            checkpoints.save(step + 1, state, data_state={"next": step + 1})
            print(f"step {step + 1}", flush=True)
            if checkpoints.reached_preemption(step + 1):
                print(f"preempted: step {step + 1} saved", flush=True)
                break
            time.sleep(0.1)
""")


def _launch(tmp_path, mode: str, *options: str) -> subprocess.CompletedProcess:
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "2", *options,
               "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script), mode, str(tmp_path / "died")]
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
           f"{sys.executable} {tmp_path / 'my_train.py'} die {tmp_path / 'died'}" in report


def test_a_script_that_dies_is_restarted(tmp_path):
    done = _launch(tmp_path, "die-once", "--max-restarts", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in done.stderr
    assert "jaxpar launch: restart 1 of 1, from the start (no complete checkpoint)" in done.stderr
    assert done.stdout.count("rank 0 of 2: 2 devices, psum 6") == 2  # the first start and the restart


def test_a_command_that_does_not_exist_is_one_line():
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--", "no-such-command-x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["error: launch: command 'no-such-command-x' not found (neither on PATH nor "
                                        "an executable file)"]


def test_sigterm_to_the_launcher_stops_a_checkpointing_loop_at_one_step_saved_by_both_ranks(tmp_path):
    script = tmp_path / "my_loop.py"
    script.write_text(LOOP)
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "2",
               "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script), str(tmp_path / "ck")]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "rank0.out"
    deadline = time.monotonic() + 90
    while not log.is_file() or "step 3\n" not in log.read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err[-3000:]
    said = {(tmp_path / "logs" / f"rank{rank}.out").read_text().splitlines()[-1] for rank in (0, 1)}
    (line,) = said  # both ranks stopped after the same step and saved it
    stopped = int(line.split()[2])
    assert line == f"preempted: step {stopped} saved" and stopped >= 3
    assert sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == [stopped]
    assert "SIGTERM forwarded; every rank saved and exited 0" in err


def test_initialize_alone_joins_nothing(monkeypatch):
    import jaxpar.distributed
    from jaxpar.train import distributed

    for name in distributed.CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_on_cloud_tpu", lambda: False)
    assert jaxpar.distributed.initialize() is False

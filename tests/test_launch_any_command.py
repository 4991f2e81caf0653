"""`jaxpar launch -n 2 -- python my_train.py`: a script of one's own as cooperating processes.

The script joins the job with `jaxpar.distributed.initialize()` and sums across the two processes; a rank that
dies is reported as a `jaxpar train` rank is (who, how, its last step, the others ended, the resume command).
"""

import json
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
    import os, sys, time
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
    once = sys.argv[2] == "exit-once"  # rank 1 exits 3 after step 5 of the first start; the restart resumes, to 8
    with Checkpoints(sys.argv[1], model, optimizer, plan, save_every=2 if once else 1000) as checkpoints:
        start = 0
        if checkpoints.latest_step() is not None:
            state, data_state = checkpoints.restore()
            start = data_state["next"]
            print(f"resumed at step {start}", flush=True)
        for step in range(start, 8 if once else 1000):
            state, metrics = train_step(state, {"x": x})
            checkpoints.save(step + 1, state, data_state={"next": step + 1})
            print(f"step {step + 1}", flush=True)
            if once and step + 1 == 5 and jax.process_index() == 1 and not os.path.exists(sys.argv[3]):
                print("my_loop: the data ran out at step 5", file=sys.stderr, flush=True)
                open(sys.argv[3], "w").write(repr(time.time()))
                sys.exit(3)  # rank 0 goes on to step 6 and waits on rank 1 in its collectives
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
    assert "SIGKILLed 0.25 s after SIGTERM: [0]" in report or "rank 0 was killed by SIGTERM" in report
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
               "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script), str(tmp_path / "ck"), "run"]
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


def test_a_checkpointing_loop_that_exits_with_an_error_is_reported_and_restarted_from_its_checkpoint(tmp_path):
    """A loop of one's own saving with `jaxpar.checkpoint.Checkpoints` every 2 steps, `sys.exit(3)` on rank 1 after
    step 5 (after `initialize()`; rank 0 waits on it in a collective): the launch reports the rank's own code within
    seconds (it stayed in jax's distributed shutdown barrier until a 60 s heartbeat ended it with 137), its last
    error lines, and the last complete checkpoint (the directory told through the heartbeat; it said "none (no
    --checkpoint-dir...)"); the restart resumes from it ("from the start", it said) and finishes."""
    script = tmp_path / "my_loop.py"
    script.write_text(LOOP)
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "2",
               "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(script),
               str(tmp_path / "ck"), "exit-once", str(tmp_path / "exited")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stderr[done.stderr.index("jaxpar launch: rank 1"):]
    assert "rank 1 exited with code 3" in report and "last step it completed:   5" in report
    assert f"its stderr ended with:    ({tmp_path / 'logs' / 'rank1.err'})" in report
    assert "\n    my_loop: the data ran out at step 5\n" in report
    assert f"last complete checkpoint: step 4 in {tmp_path / 'ck'}" in report
    assert "jaxpar launch: restart 1 of 1, from step 4" in report
    assert "resumed at step 4" in done.stdout and done.stdout.rstrip().endswith("step 8")
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    death = next(event for event in events if event["event"] == "death")
    assert death["checkpoint"] == 4 and death["cause"] == "rank 1 exited with code 3"
    exit_to_report_s = death["time"] - float((tmp_path / "exited").read_text())
    print(f"{exit_to_report_s:.2f} s from the rank's exit to the launcher's report")
    assert exit_to_report_s < 10, exit_to_report_s  # measured: 1.2 s (1 s: the waiting rank's SIGTERM grace)


def test_a_configuration_error_on_one_rank_after_initialize_ends_the_job_with_its_message(tmp_path):
    """`jaxpar train` on 2 processes whose rank 1 alone is given --mesh data=16 (through `bash -c`): rank 1 finds it
    after joining the job, while rank 0 goes on to wait for it; the launch ends with rank 1's one line and exit 2
    (it printed the error, then stayed in jax's shutdown barrier: no report and no exit at 300 s)."""
    from conftest import FAST_COMPILE

    train = (f"exec {sys.executable} -m jaxpar.cli train --devices 2 --steps 2 --batch-size 8 --seq-len 32 "
             '--mesh data=$([ "$JAX_PROCESS_ID" = 1 ] && echo 16 || echo 4)')
    command = [sys.executable, "-m", "jaxpar.cli", "launch", "-n", "2", "--devices-per-process", "2", "--",
               "bash", "-c", train]
    began = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "XLA_FLAGS": FAST_COMPILE}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: mesh data=16 has 16 devices but 4 are available"), \
        done.stderr[-3000:]
    assert "jaxpar launch" not in done.stderr and "resume with" not in done.stderr
    print(f"{time.monotonic() - began:.1f} s from the launch to its end")

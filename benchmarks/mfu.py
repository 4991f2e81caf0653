"""MFU of a dense 1B Llama in bf16 on one device (issue 16): jaxpar's step and a hand-written jit step.

The model: d_model 2048, 16 layers, 16 heads x 128, d_ff 8192, vocab 32000,
seq 2048: 1.205 B parameters, 1.139 B that multiply (all but the embedding
lookup), 7.64 GFLOPs per token by the planner's formula. fp32 parameters and
AdamW moments, bf16 compute, selective remat (the weight matmuls' outputs
kept, attention recomputed), batch 8 x 2048 = 16384 tokens per step. Memory,
as XLA:CPU's memory analysis of the same steps puts it: 14.5 GB of state
(parameters and two moments) per framework, both held at once (29 GB), and
~45 GB of temporaries while a step runs: ~75 GB of an H200's 141 GB. Batch 16
with selective remat needs ~84 GB of temporaries (~113 GB in all); `--remat
full` at batch 16 ~33 GB. The output's `memory_gb` is the device's own figure.

Both steps (`benchmarks/handwritten.py`: jaxpar's `make_train_step` on
`Plan.create("data=1", precision="bf16", remat=...)`, and a `jax.jit` step
casting the fp32 parameters to bf16 at use, optax AdamW, state donated) start
from the same parameters and see the same batches; their losses must agree to
bf16 tolerance. For each: lower + compile seconds, the median step time after
warm-up, tokens/s, MFU (the planner's model FLOPs, 6 N + attention, over the
device's dense peak from `jaxpar.planner.devices`; none on the CPU), XLA's memory figures,
and the top ops by self time from a `jax.profiler` trace of a few steps (read
from the trace JSON the profiler writes, standard library only). Then one
summary line: jaxpar / hand-written.

    python benchmarks/mfu.py                  # one H200: estimated 2-3 min (two compiles, 15 steps each)
    python benchmarks/mfu.py --tiny           # a tiny model on the CPU in seconds (checks the script)
    python benchmarks/mfu.py [--steps 10] [--warmup 2] [--batch 8] [--remat selective] [--profile-steps 3]
    JAX_PLATFORMS=cpu python benchmarks/mfu.py --target h100x8   # compile only, for one H100 (no GPU needed)

`--target NAME` (a GPU target, jaxpar.core.target: the CUDA plugin, no GPU) is the compile-only half: jaxpar's
step compiled for one device of the target on abstract state (`jaxpar.inspect`): XLA's memory, the FLOPs of
the compiled module (its matmuls and fused attention by trip count) beside the planner's, the attention
kernel chosen, and the MFU the step would reach at a given step time (`mfu_at_1s`: scale by 1 / seconds).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from handwritten import compile_jaxpar, handwritten_step, make_batch, metrics_loss, timed  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.planner import mfu  # noqa: E402
from jaxpar.models.llama import LlamaConfig  # noqa: E402
from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.planner.model import Model, llama_leaves  # noqa: E402

CONFIGS = {
    "1b": (LlamaConfig(vocab=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, d_ff=8192,
                       seq_len=2048, tie_embeddings=False), 8),
    "tiny": (LlamaConfig(vocab=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128,
                         seq_len=64, tie_embeddings=False), 4),
}
# Profiler bookkeeping on XLA:CPU's threads, not ops of the program.
CPU_NOISE = ("ThreadpoolListener::", "ThunkExecutor::", "SlinkyThreadPool::", "end: ")


def top_ops(trace_dir: str, count: int = 10) -> tuple[list | None, str]:
    """(the `count` ops with the most self time in the profile under `trace_dir`, where they came from).

    Reads the `*.trace.json.gz` that `jax.profiler` writes. On a GPU the ops
    are the events of the device processes ("/device:GPU:0"): the "XLA Ops"
    line where the trace has one, else every kernel, named by its `hlo_op`
    argument where it has one. On the CPU they are the events of XLA's
    executor threads. Self time: an event's duration less its children's on
    the same thread.
    """
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    paths = [p for p in paths if not p.endswith("perfetto_trace.json.gz")] or paths
    if not paths:
        return None, f"no *.trace.json.gz under {trace_dir}"
    with gzip.open(paths[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in processes.items() if "/device:" in name and "CPU" not in name}
    if devices:
        on_device = [e for e in spans if e["pid"] in devices]
        op_lines = {key for key, name in threads.items() if key[0] in devices and name == "XLA Ops"}
        if op_lines:
            ops, source = [e for e in on_device if (e["pid"], e["tid"]) in op_lines], "device 'XLA Ops' line"
        else:
            skip = {key for key, name in threads.items() if name in ("XLA Modules", "Steps", "XLA TraceMe")}
            ops = [e for e in on_device if (e["pid"], e["tid"]) not in skip]
            source = "device kernels (by hlo_op where given)"
    else:
        ops = [e for e in spans if threads.get((e["pid"], e["tid"]), "").startswith("tf_XLA")
               and not e["name"].startswith(CPU_NOISE)]
        source = "host XLA executor threads (CPU)"
    if not ops:
        return None, f"no op events found ({source}) in {os.path.basename(paths[-1])}"
    self_us, calls = collections.Counter(), collections.Counter()
    by_line = collections.defaultdict(list)
    for e in ops:
        by_line[e["pid"], e["tid"]].append(e)
    for line in by_line.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self time so far]
        for e in line:
            while stack and e["ts"] >= stack[-1][0]:
                _, name, own = stack.pop()
                self_us[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            name = (e.get("args") or {}).get("hlo_op") or e["name"]
            calls[name] += 1
            stack.append([e["ts"] + e["dur"], name, e["dur"]])
        for _, name, own in stack:
            self_us[name] += own
    total = sum(self_us.values()) or 1.0
    return [{"op": name, "self_ms": round(us / 1e3, 3), "share": round(us / total, 4), "calls": calls[name]}
            for name, us in self_us.most_common(count)], source


def memory(compiled) -> dict | None:
    """XLA's bytes for the compiled step (arguments, outputs, temporaries), in GB; None where not reported."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        return None
    if m is None:
        return None
    return {k: round(getattr(m, f"{k}_size_in_bytes") / 1e9, 3) for k in ("argument", "output", "temp", "alias")}


def profile(run, state, place, batch, first: int, steps: int):
    """(top ops, where they came from) of `steps` steps run under `jax.profiler.trace` (None and why if it fails)."""
    with tempfile.TemporaryDirectory(prefix="jaxpar_mfu_") as directory:
        try:
            with jax.profiler.trace(directory):
                timed(run, state, place, first, steps, batch)
            return top_ops(directory)
        except Exception as e:  # noqa: BLE001 - no profiler on this host (e.g. no CUPTI): the figures stand without
            return None, f"profile failed: {type(e).__name__}: {e}"


def compile_only(args) -> int:
    """jaxpar's step compiled for one device of `args.target`: one JSON line; nothing runs."""
    import time

    import optax
    from flax import nnx

    import jaxpar.inspect
    from jaxpar.core import target
    from jaxpar.models.llama import Llama
    from jaxpar.train.state import describe
    from jaxpar.train.step import make_train_step

    config, default_batch = CONFIGS[args.config]
    batch_size = args.batch or default_batch
    try:
        devices = target.one_device(args.target)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plan = Plan.create("data=1", devices=devices, precision="bf16", remat=args.remat)
    model = describe(lambda: Llama(config, nnx.Rngs(0)))
    optimizer = optax.adamw(1e-3)
    state = jaxpar.inspect.abstract_state(model, optimizer, plan)
    batch = {k: jax.ShapeDtypeStruct((batch_size, config.seq_len), np.int32, sharding=plan.sharding(plan.batch_spec(2)))
             for k in ("inputs", "targets")}
    step = make_train_step(model, lambda module, b: module(b), optimizer, plan)
    began = time.perf_counter()
    report = jaxpar.inspect.inspect_step(step, state, batch)
    run_mfu = mfu.for_run("llama", config, batch_size, config.seq_len, "bf16", list(devices), args.peak_flops)
    print(json.dumps({
        "benchmark": "mfu", "mode": "compile-only", "target": args.target, "device_kind": devices[0].device_kind,
        "config": args.config, "jax": jax.__version__, "params": config.param_count(), "batch": batch_size,
        "seq_len": config.seq_len, "remat": args.remat, "compile_s": round(time.perf_counter() - began, 2),
        "memory_gb": {k: round(v / 1e9, 3) for k, v in report["memory"].items()},
        "compiled_flops": report["flops"], "matmul_flops": report["matmul_flops"],
        "model_flops_per_step": run_mfu.flops_per_step, "attention": report["attention"],
        "mfu_at_1s": None if run_mfu(1.0) is None else round(run_mfu(1.0), 4),
    }), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="1b")
    parser.add_argument("--tiny", action="store_const", const="tiny", dest="config", help="same as --config tiny")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 for 1b, 4 tiny)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per framework")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps traced for the top ops (0: none)")
    parser.add_argument("--remat", choices=("none", "selective", "full"), default="selective")
    parser.add_argument("--peak-flops", type=float, default=None, help="FLOP/s of the device, if not in jaxpar.planner.devices")
    parser.add_argument("--target", default=None, help="compile only, for one device of this GPU target (h100x8, "
                                                           "...: needs the CUDA plugin and JAX_PLATFORMS=cpu)")
    args = parser.parse_args()
    if args.target:
        return compile_only(args)
    config, default_batch = CONFIGS[args.config]
    batch_size = args.batch or default_batch
    device = jax.devices()[0]
    plan = Plan.create("data=1", devices=[device], precision="bf16", remat=args.remat)
    batch = functools.partial(make_batch, config=config, batch_size=batch_size)
    place = functools.partial(jax.device_put, device=plan.sharding(plan.batch_spec(2)))
    sample = place(batch(0))

    model, state, compiled, _, _, figures = compile_jaxpar(plan, config, sample)
    hand_state, hand, hand_compile_s = handwritten_step(plan, model, state.params, batch(0), args.remat)
    frameworks = {
        "jaxpar": {"run": metrics_loss(compiled), "state": state, "compiled": compiled,
                   "compile_s": round(figures["lower_s"] + figures["compile_s"], 2)},
        "handwritten": {"run": lambda s, b, c=hand: c(s, b), "state": hand_state, "compiled": hand,
                        "compile_s": hand_compile_s},
    }
    run_mfu = mfu.for_run("llama", config, batch_size, config.seq_len, "bf16", [device], args.peak_flops)
    counted = Model.from_config("llama", config, llama_leaves(config))
    tokens = batch_size * config.seq_len
    common = {"benchmark": "mfu", "config": args.config, "device_kind": device.device_kind, "jax": jax.__version__,
              "params": config.param_count(), "flop_params": counted.flop_params, "batch": batch_size,
              "seq_len": config.seq_len, "tokens_per_step": tokens, "precision": "bf16", "remat": args.remat,
              "model_flops_per_step": run_mfu.flops_per_step}
    results = {}
    for name, f in frameworks.items():  # the same batches, from the same initial parameters, for each
        s, _, warm_losses, _ = timed(f["run"], f["state"], place, 0, args.warmup, batch)
        s, median_s, losses, seconds = timed(f["run"], s, place, args.warmup, args.steps, batch)
        ops, source = None, "--profile-steps 0"
        if args.profile_steps:
            ops, source = profile(f["run"], s, place, batch, args.warmup + args.steps, args.profile_steps)
        f["state"] = s = None  # donated: free this framework's state before the next runs
        value = run_mfu(median_s)
        results[name] = {
            **common, "framework": name, "compile_s": f["compile_s"], "step_s_median": round(median_s, 4),
            "step_s": [round(t, 4) for t in seconds], "tokens_per_s": round(tokens / median_s, 1),
            "model_tflops_per_s": round(run_mfu.flops_per_step / median_s / 1e12, 3),
            "mfu": None if value is None else round(value, 4), **({"mfu_note": run_mfu.why_not} if value is None
                                                                  else {}),
            "losses": warm_losses + losses, "memory_gb": memory(f["compiled"]), "top_ops": ops,
            "top_ops_source": source,
        }
        print(json.dumps(results[name]), flush=True)
    ours, theirs = results["jaxpar"], results["handwritten"]
    relative = np.abs(np.array(ours["losses"]) / np.array(theirs["losses"]) - 1)
    print(json.dumps({
        "benchmark": "mfu", "summary": "jaxpar / handwritten", "config": args.config,
        "step_time_ratio": round(ours["step_s_median"] / theirs["step_s_median"], 3),
        "tokens_per_s_ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "mfu": [ours["mfu"], theirs["mfu"]], "compile_s": [ours["compile_s"], theirs["compile_s"]],
        "first_loss_relative_difference": float(relative[0]),
        "max_loss_relative_difference": float(relative.max()),
        "losses_agree": bool(relative.max() <= 2e-2),  # bf16: 8 mantissa bits, drifting a little over steps
    }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

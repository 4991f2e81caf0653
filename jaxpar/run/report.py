"""What `jaxpar` shows a person: the mesh, the parameter layout, training progress, a compiled step."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import jax
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from jaxpar.core import compile_cache, device_facts, gpu_profile, zero_layout
from jaxpar.core.timeline import mark
from jaxpar.parallel import attention_kernels, expert_kernels
from jaxpar.planner import inspect as inspect_lib
from jaxpar.run import preference
from jaxpar.run.training import (
    Run,
    changed_settings,
    iterate,
    open_checkpoints,
    param_table,
    resume,
)
from jaxpar.data.block_packing import BlockBatches
from jaxpar.data.epochs import EpochBatches
from jaxpar.data.packed_mixture import CHUNK, PackedMixture
from jaxpar.data.stream import skipped_records
from jaxpar.data.tokens import BadBatch
from jaxpar.train.distributed import PREEMPTED_MARKER
from jaxpar.train.state import abstract_state


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def show_layout(run: Run, console: Console) -> None:
    shape = run.plan.shape
    mesh = " x ".join(f"{a}={s}" for a, s in shape.items())
    facts = device_facts.of_mesh(run.plan.mesh)
    if facts.target:  # compile-only devices: what the step is compiled for, not this process's
        hosts = f"{facts.hosts} host{'s' if facts.hosts > 1 else ''}"
        console.print(f"[bold]mesh[/] {mesh} on target {facts.target}: {facts.devices} x {facts.kind} ({hosts}; "
                      f"compiled only)")
    else:
        console.print(f"[bold]mesh[/] {mesh} on {jax.device_count()} {jax.devices()[0].platform} devices "
                      f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''}"
                      + (f"; across processes: {', '.join(inspect_lib.process_axes(run.plan.mesh))})"
                         if jax.process_count() > 1 else ")"))
    options = {k: v for k, v in vars(run.plan).items() if k not in ("mesh", "rules")}
    console.print("[bold]plan[/] " + ", ".join(f"{k}={v}" for k, v in options.items()))
    if zero_layout.no_effect_message(run.plan):
        console.print(f"[yellow]note:[/] {zero_layout.no_effect_message(run.plan)}")
    elif run.plan.zero:
        console.print(escape(str(run.plan.zero_report(run.model.logical))).split("\n")[0])
    table = Table(title=f"{run.config.model}: {run.model.param_count():,} parameters", show_lines=False)
    for column in ("parameter", "shape", "logical axes", "sharding", "per device"):
        table.add_column(column)
    for row in param_table(run):
        logical = ",".join(str(name) for name in row["logical"])
        shape = "x".join(map(str, row["shape"]))
        table.add_row(row["path"].replace("']['", ".").strip("[']"), shape, logical, row["spec"][1:],
                      _bytes(row["bytes_per_device"]))
    console.print(table)


def mfu_text(run: Run, step_time_s: float | None) -> str:
    """`MFU 41.2%` for a step time, `MFU n/a (CPU)` (or why else there is none), or "" before any step."""
    if run.mfu.peak is None:
        return f"MFU {run.mfu.why_not}"
    return "" if step_time_s is None else f"MFU {run.mfu(step_time_s):.1%}"


def _epoch_text(run: Run, console: Console):
    """With `--epochs`: say how the data splits into rows, and give the progress bar's `  epoch 1.25` per step."""
    if isinstance(run.batches, BlockBatches):  # rows are counted as blocks are packed: no total before the run
        counted = (f": {run.batches.rows_per_epoch:,} rows, {run.config.epochs:g} epochs = {run.config.steps:,} steps"
                   if run.config.epochs is not None else "")  # --epochs counted every block already
        shared = run.batches.shared
        if shared is not None:
            counted += (f"; process {shared.process} of {shared.processes} tokenized {len(run.batches.tokenized):,} "
                        "of them so far (each counts its own blocks, the processes share the counts)")
        console.print(f"[bold]data[/] {len(run.batches.source):,} documents in {run.batches.blocks:,} blocks, "
                      f"packed as batches need them, each row once per epoch{counted}")
        return lambda step: f"  epoch {run.batches.epoch_of(step):.2f}"
    if isinstance(run.batches, PackedMixture):
        mixture = run.batches
        shares = ", ".join(f"{Path(str(name)).name} {n / CHUNK:.0%}" for name, n in zip(mixture.names, mixture.quota))
        console.print(f"[bold]data[/] a mixture of {len(mixture.sources)} packed sources ({shares} of the rows), "
                      "each through its own epochs")
        return lambda step: "  epoch " + " ".join(f"{Path(str(name)).name} {epoch:.2f}"
                                                  for name, epoch in mixture.source_epochs(step).items())
    if not isinstance(run.batches, EpochBatches):
        return lambda step: ""
    table, config = run.batches.table, run.config
    dropped = getattr(table, "dropped", 0)
    epochs = run.batches.epoch_of(config.steps) if config.epochs is None else config.epochs  # packed rows: --steps
    console.print(f"[bold]data[/] {len(table):,} rows of {config.seq_len + 1} tokens, each once per epoch: "
                  f"{epochs:.4g} epochs = {config.steps:,} steps of {config.batch_size}"
                  + (f" ({dropped} tokens at the end fill no row and are not read)" if dropped else ""))
    return lambda step: f"  epoch {run.batches.epoch_of(step):.2f}"


def train_with_progress(run: Run, console: Console) -> int:
    """Train with a progress bar (loss, tokens/s, step time, MFU) and print the loss curve's key points.

    The closing line's tokens/s and MFU are those of the median step after
    the first, whose time includes compiling (`closing_line`).

    With a checkpoint directory the run continues from its newest checkpoint;
    SIGTERM saves after the current step and returns 0.
    """
    show_layout(run, console)
    try:
        checkpoints = open_checkpoints(run)
        state, position = resume(run, checkpoints)
        mark("restored")
    except ValueError as error:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2
    start, row = position["step"], {}
    if start:
        mesh = (position["config"] or {}).get("mesh", {})
        under = (",".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "one device") if mesh else "an unknown plan"
        console.print(f"[bold]resumed[/] from step {start} in {checkpoints.directory} (saved under {under})")
        for change in changed_settings(position, run):
            console.print(f"[yellow]changed since that checkpoint:[/] {change}")
    epochs = _epoch_text(run, console)
    log_every = max(1, run.config.steps // 10)
    losses, times = [], []
    columns = (TextColumn("[bold]step {task.completed}/{task.total}{task.fields[epoch]}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  {task.fields[ms]:.1f} ms/step"
                          "  {task.fields[mfu]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=run.config.steps, completed=start, loss=float("nan"), tps=0.0, ms=0.0,
                                 mfu=mfu_text(run, None), epoch=epochs(start))
        try:
            compiles = compile_cache.Watch()
            for state, row in iterate(run, state, start, checkpoints, position.get("nonfinite_steps", 0)):
                if not losses:  # traced and compiled now: what attention and the experts got, where the step came from
                    chosen = "; ".join(attention_kernels.choices(run.step_fn.used))
                    progress.console.print(f"[bold]attention[/] {escape(chosen)}")
                    for moe in expert_kernels.choices(run.step_fn.used):
                        progress.console.print(f"[bold]moe kernel[/] {escape(moe)}")
                    progress.console.print(f"[bold]step[/] {escape(compiles.source() or 'compiled')}")
                    mark("first step")
                losses.append(row["loss"])
                times.append(row["step_time_s"])
                progress.update(task, completed=row["step"], loss=row["loss"], tps=row["tokens_per_s"],
                                ms=row["step_time_s"] * 1e3, mfu=mfu_text(run, row["step_time_s"]),
                                epoch=epochs(row["step"]))
                if row["step"] % log_every == 0 or row["step"] == 1:
                    progress.console.print(progress_line(row))
        except FloatingPointError as error:
            Console(stderr=True).print(f"[bold red]stopped:[/] {error}")
            return 1
        except BadBatch as error:  # token ids outside the vocabulary, found in a later batch
            Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
            return 2
        finally:
            if checkpoints is not None:
                checkpoints.close()
    if row.get("preempted"):
        console.print(f"[bold yellow]preempted[/] (SIGTERM): step {row['step']} saved in {checkpoints.directory}")
        if jax.process_index() == 0:  # this attempt was preempted, saved: a scheduler's script requeues on it (README)
            (checkpoints.directory / PREEMPTED_MARKER).write_text(f"{row['step']}\n")
    if losses:
        console.print(closing_line(run, losses, times))
    return 0


def progress_line(row: dict) -> str:
    """A training row as one line: `step    10  loss 5.123456  lr 0.001  grad_norm 1.2  ...` (its floats)."""
    extras = "  ".join(f"{k} {v:.4g}" for k, v in row.items()
                       if isinstance(v, float) and k not in ("loss", "step_time_s", "tokens_per_s"))
    return f"step {row['step']:>5}  loss {row['loss']:.6f}  {extras}"


def closing_line(run: Run, losses: list[float], times: list[float]) -> str:
    """The run's last line: the loss from first to last step, and the median step time of the steps after the
    first (whose time includes compiling), or, with one step only, its time marked as compiling included."""
    line = (f"[bold green]done[/]: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} "
            f"step{'s' if len(losses) > 1 else ''}; ")
    if len(times) > 1:
        steady = sorted(times[1:])[(len(times) - 1) // 2]
        line += (f"median step {steady * 1e3:.1f} ms (compile step left out), "
                 f"{run.config.batch_size * run.config.seq_len / steady:,.0f} tok/s, {mfu_text(run, steady)}")
    else:
        line += (f"its time {times[0] * 1e3:.1f} ms includes compiling, so it gives no step time; "
                 "run 2 or more steps for one")
    bad, no_reply = skipped_records(run.batches)
    if bad:
        line += f"; {bad:,} bad record{'s' if bad > 1 else ''} skipped (--skip-bad-records)"
    if no_reply:
        line += f"; {no_reply:,} conversation{'s' if no_reply > 1 else ''} with no assistant reply skipped (nothing to train on)"
    return line


def inspection(run: Run, gpu_flags: str = "auto") -> dict:
    """Compile one step on abstract inputs (no parameters allocated) and read it back; for a GPU target with the
    GPU profile's XLA flags as compile options (`gpu_flags` auto)."""
    state = abstract_state(run.model, run.optimizer, run.plan)
    shape = (run.config.batch_size, run.config.seq_len)
    fields = {k: jax.numpy.int32 for k in ("inputs", "targets")}
    if run.config.objective:  # a preference batch: the fields its objective reads (jaxpar.run.preference)
        fields = preference.batch_fields(run)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=run.batch_sharding) for k, dtype in fields.items()}
    facts = device_facts.of_mesh(run.plan.mesh)
    with compile_cache.suspended() if facts.target else contextlib.nullcontext():
        compiled, flags, unknown = gpu_profile.compile_with(run.step_fn.lower(state, batch),
                                                            gpu_profile.compile_options(facts, gpu_flags))
    summary = inspect_lib.summary(compiled, run.plan.mesh, run.plan)
    if facts.target:
        summary["gpu_flags"] = {"applied": sorted(flags), "not_compile_options": unknown}
    return {"model": run.config.model, "params": run.model.param_count(), **_device_fields(facts),
            "attention": attention_kernels.choices(run.step_fn.used),
            **({"moe_kernel": moe} if (moe := expert_kernels.choices(run.step_fn.used)) else {}), **summary}


def _device_fields(facts) -> dict:
    """What the step was compiled for: the target's name (absent for this process's devices) and device kind."""
    return {"target": facts.target, "device_kind": facts.kind} if facts.target else {}


def print_inspection(run: Run, console: Console, as_json: bool, gpu_flags: str = "auto") -> int:
    report = inspection(run, gpu_flags)
    if as_json:
        print(json.dumps(report))
        return 0
    show_layout(run, console)
    show_compiled(report, console)
    return 0


def show_compiled(report: dict, console: Console) -> None:
    """A compiled step's figures (`jaxpar.planner.inspect.summary`, with `attention` when known) as tables."""
    table = Table(title="collectives per device per step")
    for column in ("kind", "axes", "count", "buffers", "bytes", "traffic"):  # the JSON's keys, in its words
        table.add_column(column, justify="right" if column not in ("kind", "axes") else "left")
    for row in report["collectives"]:
        table.add_row(row["kind"], ",".join(row["axes"]), str(row["count"]), str(row["buffers"]),
                      _bytes(row["bytes"]), _bytes(row["traffic"]))
    console.print(table)
    memory = Table(title="memory per device")
    for column in ("arguments", "outputs", "temp", "total"):
        memory.add_column(column, justify="right")
    memory.add_row(*(_bytes(report["memory"][k]) for k in ("arguments", "outputs", "temp", "total")))
    console.print(memory)
    console.print(f"[bold]FLOPs per device per step[/] {report['flops']:.4g}")
    if report.get("attention"):
        console.print(f"[bold]attention[/] {escape('; '.join(report['attention']))}")
    if pipe := report.get("pipeline"):
        ring = "" if pipe["peak_residual_bytes"] is None else (
            f", residual ring {pipe['ring_rows']} rows, {_bytes(pipe['peak_residual_bytes'])}")
        console.print(f"[bold]pipeline[/] {pipe['schedule']}: bubble {pipe['bubble']:.1%}, "
                      f"{pipe['live_microbatches']:g} microbatches' residuals live{ring}")

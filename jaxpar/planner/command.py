"""`jaxpar plan`: the ranked layouts as a table, one layout explained, and the command or config that runs it."""

from __future__ import annotations

import dataclasses

from jaxpar.planner.adapters import with_lora
from jaxpar.planner.devices import DEVICES, Device, for_facts, load_device
from jaxpar.planner.estimate import Estimate, estimate
from jaxpar.planner.layout import Layout, Workload
from jaxpar.planner.model import Model, model_seq
from jaxpar.planner.pictures import save_pictures
from jaxpar.planner.search import Ranking, default_batch, explain_choice, plan


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x < 1e13 else "inf"


def run_command(model_name: str, est: Estimate, work: Workload, trains: tuple = ()) -> str:
    """The `jaxpar train` command line that runs this layout; `trains`: what the model trains as Plan options
    (`Model.plan_options`: LoRA's)."""
    flags = [f"--model {model_name}", f"--mesh {est.layout.mesh}", f"--batch-size {work.batch_size}",
             f"--seq-len {work.seq_len}"]
    for key, value in {**est.layout.options(), **dict(trains)}.items():
        flag = "--" + key.replace("_", "-")
        flags.append((flag if value else "--no-" + flag[2:]) if isinstance(value, bool) else f"{flag} {value}")
    return "jaxpar train " + " ".join(flags)


def config_toml(model_name: str, est: Estimate, work: Workload, trains: tuple = ()) -> str:
    """A `jaxpar train --config FILE` file for this layout ([model], [train], [mesh], [plan] tables); `trains` as
    `run_command` takes it."""
    mesh = "\n".join(f"{a} = {n}" for a, n in est.layout.shape.items())
    plan_lines = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v if isinstance(v, int) else repr(v)}"
                           .replace("'", '"') for k, v in {**est.layout.options(), **dict(trains)}.items())
    return (f"# jaxpar plan: {est.layout}\n# predicted {est.step_time:.3g} s/step, MFU {est.mfu:.0%}, "
            f"{_gb(est.peak)} GB per device\n[model]\nname = \"{model_name}\"\n\n[train]\n"
            f"batch_size = {work.batch_size}\nseq_len = {work.seq_len}\n\n[mesh]\n{mesh}\n\n[plan]\n{plan_lines}\n")


def table(ranking: Ranking, top: int = 10):
    """The ranked layouts as a rich table: memory breakdown (GB), traffic per axis (GB), bubble, time, MFU."""
    from rich.table import Table

    precision = ranking.ranked[0].layout.precision if ranking.ranked else ""
    t = Table(title=f"{ranking.model.name} ({ranking.model.params / 1e9:.3g}B parameters) on {ranking.devices} x "
                    f"{ranking.device.name}, {precision}: batch {ranking.work.batch_size} x {ranking.work.seq_len} "
                    f"tokens; memory and traffic in GB per device per step")
    for col in ("#", "layout", "params", "grads", "optim", "activ", "temp", "total", "data", "tensor", "pipe",
                "expert", "bubble", "step s", "MFU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, est in enumerate(ranking.ranked[:top], 1):
        m, tr = est.memory, est.traffic
        t.add_row(str(i), est.layout.label(precision=False), _gb(m["params"]), _gb(m["grads"]), _gb(m["optimizer"]),
                  _gb(m["activations"]), _gb(m["temp"]), _gb(m["total"]),
                  *(_gb(tr.get(a, 0.0)) for a in ("data", "tensor", "pipe", "expert")),
                  f"{est.bubble:.1%}", f"{est.step_time:.3g}", f"{est.mfu:.0%}")
    return t


def explain(est: Estimate, device: Device) -> list[str]:
    """One layout's breakdown: memory, every collective, bubble, FLOPs and time."""
    if est.reason and not est.memory.get("params"):
        return [f"{est.layout}: cannot run: {est.reason}"]
    m, t = est.memory, est.time
    lines = [f"layout {est.layout} on {est.layout.devices} x {device.name}"]
    lines.append("memory per device (GB): " + ", ".join(
        f"{k} {_gb(m[k])}" for k in ("params", "grads", "optimizer", "activations", "temp", "batch", "total"))
        + (f" -> fits in {_gb(device.capacity)} usable" if est.fits else f" -> does NOT fit: {est.reason}"))
    lines.append("collectives per device per step:")
    for c in est.collectives:
        lines.append(f"  {c.axis:7s} {c.kind:18s} {c.calls:8.0f} calls x {c.bytes / 1e6:10.3f} MB -> "
                     f"{c.traffic(est.layout.shape[c.axis]) / 1e9:8.3f} GB traffic  ({c.why})")
    lines.append(f"bubble {est.bubble:.1%}; model FLOPs {est.flops:.3g} per device (with recomputation "
                 f"{est.hardware_flops:.3g})")
    lines.append("time (s): " + ", ".join(f"{k} {v:.3g}" for k, v in t.items()) + f"; MFU {est.mfu:.1%}")
    return lines


def _cluster(args):
    """The planner's device for --target (its counts set on `args`), or --device (default h100; 8 devices)."""
    if args.target is None:
        args.devices = 8 if args.devices is None else args.devices
        return load_device(args.device or "h100")
    from jaxpar.core.target import parse

    target = parse(args.target)
    given = [f for f, v in (("--device", args.device), ("--devices", args.devices), ("--hosts", args.hosts)) if v]
    if given:
        raise ValueError(f"--target {args.target} sets the device and the device and host counts: drop "
                         f"{', '.join(given)}")
    facts = target.facts()
    device = for_facts(facts)
    if device is None:
        raise ValueError(f"target {args.target}: the planner has no figures for {facts.kind!r} (built in: "
                         f"{', '.join(d.name for d in DEVICES.values())}); give --device FILE.toml instead")
    args.devices, args.hosts = target.hosts * target.per_host, target.hosts
    return device


def main(args, verify=None) -> int:
    """`jaxpar plan`: rank the layouts, or explain one; table, JSON, pictures, a runnable config. `verify`
    (`jaxpar.run.verify.verify`, with --verify N --target): the top N compiled for the target, their memory read back."""
    import json
    import sys

    from rich.console import Console

    console = Console(stderr=bool(args.json))
    if not console.is_terminal:
        console.width = 220
    try:
        device = _cluster(args)
        if args.hosts:
            if args.devices % args.hosts:
                raise ValueError(f"--devices {args.devices} do not divide over --hosts {args.hosts}")
            device = dataclasses.replace(device, devices_per_node=args.devices // args.hosts)
        model = Model.named(args.model, {"seq_len": args.seq_len} if args.seq_len else None)
        if args.lora_rank:
            model = with_lora(model, args.lora_rank, args.lora_targets, args.base_dtype)
        elif args.base_dtype != "none" or args.lora_targets != "q,k,v,o":
            raise ValueError("--base-dtype / --lora-targets are set but --lora-rank is 0 (every weight trains): "
                             "set --lora-rank")
        seq = args.seq_len or model_seq(args.model)
        work = Workload(args.batch_size or default_batch(model, args.devices, seq), seq)
        if args.explain:
            layout = dataclasses.replace(Layout.parse(args.explain), precision=args.precision) \
                if "precision" not in args.explain else Layout.parse(args.explain)
            if layout.devices != args.devices:
                raise ValueError(f"layout {layout.mesh} has {layout.devices} devices, --devices says {args.devices}")
            est = estimate(model, layout, work, device)
            for line in explain(est, device):
                console.print(line, highlight=False, soft_wrap=True)
            if args.json:
                print(json.dumps(est.to_dict(), default=float))
            return 0
        ranking = plan(model, args.devices, work, device, args.precision)
    except ValueError as error:
        from rich.markup import escape

        console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2
    console.print(table(ranking, args.top))
    for line in explain_choice(ranking):
        console.print(line, highlight=False, soft_wrap=True)
    if ranking.best is not None:
        console.print("run it: " + run_command(args.model, ranking.best, work, model.plan_options), highlight=False, soft_wrap=True)
        if args.write_config:
            with open(args.write_config, "w") as f:
                f.write(config_toml(args.model, ranking.best, work, model.plan_options))
            console.print(f"wrote {args.write_config} (jaxpar train --config {args.write_config})")
    verified = []
    if verify is not None and ranking.ranked:
        try:
            verified = verify(args.model, ranking.ranked[:args.verify], work, args.target, device.capacity,
                              model.plan_options)
        except ValueError as error:
            from rich.markup import escape

            console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
            return 2
        console.print(f"compiled for {args.target} (memory per device, GB): layout: planner, compiled, "
                      "planner / compiled, fits", highlight=False, soft_wrap=True)
        for row in verified:
            console.print("  " + row.line(), highlight=False, soft_wrap=True)
    if args.png:
        for path in save_pictures(ranking, args.png):
            console.print(f"wrote {path}")
    if args.json:
        out = ranking.to_dict(args.top)
        if ranking.best is not None:
            out["command"] = run_command(args.model, ranking.best, work, model.plan_options)
        if verified:
            out["verified"] = [row.to_dict() for row in verified]
        json.dump(out, sys.stdout, default=float)
        print()
    return 0

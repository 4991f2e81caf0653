"""`jaxpar plan --scaling weak|strong`: the scaling table (jaxpar.planner.scaling), its JSON and plot, and with
--target the one-, two- and four-host counts compiled, their collectives' bytes beside the planner's."""

from __future__ import annotations

from jaxpar.planner.command import _cluster
from jaxpar.planner.model import Model, model_seq
from jaxpar.planner.scaling import COUNTS, FAMILIES, save_plot, scaling, table, to_dict


def _counts(text: str | None) -> tuple[int, ...]:
    if text is None:
        return COUNTS
    try:
        counts = tuple(sorted({int(c) for c in text.split(",")}))
    except ValueError:
        raise ValueError(f"--counts takes device counts separated by commas, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--counts must be >= 1, got {text!r}")
    return counts


def _refuse_plan_options(args) -> None:
    """The ranking's own options do not act on a scaling table: refused, not ignored."""
    given = [flag for flag, on in (("--explain", args.explain), ("--verify", args.verify), ("--png", args.png),
                                   ("--write-config", args.write_config), ("--lora-rank", args.lora_rank),
                                   ("--devices", args.devices)) if on]
    if given:
        raise ValueError(f"--scaling takes its device counts from --counts: {', '.join(given)} do not apply to it")


def _setup(args):
    """The model, device, counts, families and batch of a scaling run (ValueError: one line)."""
    _refuse_plan_options(args)
    families = tuple(f.strip() for f in args.family.split(",") if f.strip())
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"--family: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(FAMILIES)})")
    counts = _counts(args.counts)
    device = _cluster(args)  # --target: the host's device (8 per node), args.devices = one host
    if args.target is None and args.hosts:
        raise ValueError("--scaling: the hosts follow from the counts (8 devices per node): drop --hosts")
    model = Model.named(args.model, {"seq_len": args.seq_len} if args.seq_len else None)
    seq = args.seq_len or model_seq(args.model)
    batch = args.batch_size or (counts[0] if args.scaling == "weak" else counts[-1])  # one sequence per device
    return model, device, counts, families, batch, seq


def main(args, compile_hosts=None) -> int:
    """Print the table (and --json), write --plot, and with --target compile the whole-host counts
    (`compile_hosts`: `jaxpar.run.verify.check_scaling_hosts`, handed in by the CLI, a layer above the planner)."""
    import json
    import sys

    from rich.console import Console

    console = Console(stderr=bool(args.json))
    if not console.is_terminal:
        console.width = 200
    try:
        model, device, counts, families, batch, seq = _setup(args)
        result = scaling(model, args.scaling, families, counts, batch, seq, device, args.precision)
        checks = None
        if args.target is not None and compile_hosts is not None:
            checks = compile_hosts(args.model, result, counts, args.target, device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    console.print(table(result, model, args.scaling, device))
    if checks is not None:
        console.print(f"compiled for {args.target}'s hosts (stand-in: {args.model} with 2 layers, 256 tokens, one "
                      "sequence per device): traffic per device per step, planner / compiled", highlight=False)
        for check in checks:
            console.print("  " + check.line(), highlight=False, soft_wrap=True)
    if args.plot:
        console.print(f"wrote {save_plot(result, model, args.scaling, device, args.plot)}")
    if args.json:
        out = {"model": model.name, "params": model.params, "mode": args.scaling, "device": device.name,
               "seq_len": seq, "families": to_dict(result)}
        if checks is not None:
            out["compiled"] = [c.to_dict() for c in checks]
        json.dump(out, sys.stdout, default=float)
        print()
    return 0


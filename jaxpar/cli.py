"""`jaxpar train | inspect | export | launch`: the command line over jaxpar.run.training, jaxpar.planner.inspect and jaxpar.interop.export.

jax is imported only after the arguments are read, so `--devices` can set the
number of host (CPU) devices before jax initialises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib

from jaxpar import cli_weights

TRAIN_FLAGS = {
    "model": (str, "model name (tiny, small, 1b, 7b, 70b, 405b, ...)"),
    "steps": (int, "total optimizer steps of the run"),
    "epochs": (float, "instead of --steps: passes over the data, each row once per epoch in an order shuffled by "
                      "--seed (steps = ceil(epochs x rows / batch size); 0.5 and 2.5 allowed)"),
    "batch_size": (int, "global batch size in sequences"),
    "seq_len": (int, "tokens per sequence"),
    "lr": (float, "peak learning rate (AdamW, warm-up then cosine decay)"),
    "warmup": (int, "warm-up steps"),
    "seed": (int, "seed of the initial parameters and of the batch sequence"),
    "data": (str, "text file or folder, .npy/.bin token file, .jsonl, .parquet, a datasets save_to_disk folder, "
                  "or a weighted mixture a.jsonl:0.7,b.bin:0.3 (default: built-in corpus)"),
    "text_field": (str, "the field of each .jsonl / .parquet / datasets record that holds its text (default: text)"),
    "packing": (str, "documents: whole documents packed into rows, attention and loss inside each (the default for "
                     ".jsonl, Parquet, datasets and text folders; fine-tuning records train on their completions); "
                     "windows: random windows of the token stream (token files, one text file, mixtures)"),
    "metrics": (str, "append one JSON object per step to this file"),
    "checkpoint_dir": (str, "save sharded checkpoints here and resume from the newest one on start"),
    "save_every": (int, "save a checkpoint every N steps (async; also at the end and on SIGTERM)"),
    "keep": (int, "keep the newest K checkpoints"),
    "on_nonfinite": (str, "a step with a NaN/Inf loss or gradient: skip its update, or stop the run"),
    "init_from": (str, "start from these weights: `jaxpar import-hf` output, an export, or a Hugging Face directory"),
    "adapter": (str, "with --init-from BASE: continue training this PEFT LoRA adapter folder on BASE (its r, "
                     "lora_alpha and target_modules set --lora-rank, --lora-alpha and --lora-targets)"),
    "eval_every": (int, "every N steps, loss and perplexity on a held-out 5%% tail of the data (then not trained on)"),
    "tokenizer": (str, "tokenize text --data with this Hugging Face tokenizer.json or SentencePiece .model "
                       "(default: UTF-8 bytes); with a .npy from `jaxpar tokenize`, check that it was made with it"),
    "tensorboard": (str, "also write loss, lr, grad norm, tokens/s, MFU and memory as TensorBoard scalars here"),
    "peak_flops": (float, "peak FLOP/s of one device, for MFU where the built-in table (jaxpar.planner.devices) lacks the device"),
    "compile_cache": (str, cli_weights.COMPILE_CACHE_HELP),
    "objective": (str, "train with another objective than next-token cross-entropy: dpo, simpo or orpo on --data "
                       "records with prompt, chosen and rejected (text or chat messages; TRL's format), or grpo on "
                       "completions sampled for --prompts and scored by --reward"),
    "beta": (float, "the objective's beta: DPO's KL strength (default 0.1), SimPO's reward scale (2.0), ORPO's odds-ratio "
                    "weight lambda (0.1), GRPO's weight of the KL to the reference (0)"),
    "dpo_loss": (str, "DPO's loss: sigmoid (default), ipo, hinge or robust (as TRL's loss_type)"),
    "label_smoothing": (float, "robust DPO's chance that a preference was flipped (in [0, 0.5)); SimPO's label "
                               "smoothing"),
    "simpo_gamma": (float, "SimPO's target reward margin gamma (default 0.5)"),
    "sft_weight": (float, "SimPO: add the chosen answers' cross-entropy with this weight (CPO's cpo_alpha; default 0)"),
    "precompute_reference": (bool, "DPO: compute the reference's log-probs once from the initial weights (the base "
                                   "under LoRA) and carry them with the data; needed without LoRA and under pipe > 1"),
    "skip_bad_records": (bool, "train without a document source's bad records (malformed JSON, missing fields, unknown "
                               "chat roles) instead of refusing it; start-up says how many are left out"),
}
CONFIG_TABLES = ("model", "train", "mesh", "plan", "lora")
LORA_KEYS = ("rank", "alpha", "targets", "dropout", "base_dtype")  # a [lora] table's keys: the plan's lora_rank, ...
TARGET_HELP = ("compile for these NVIDIA hosts instead of this machine's devices (no GPU needed; nothing runs): "
               "h100x8, h200x8, a100-80x8, b200x8, 2xh100x8 (two hosts over InfiniBand), or a target config "
               "file (.txtpb); needs the CUDA plugin (pip install \"jaxpar[gpu-target]\"); also [plan] target")
DEFAULT_MESH = "3d-2x2x2"  # data=2, tensor=2, pipe=2 with ZeRO-1, when exactly 8 devices are there


def _plan_fields():
    from jaxpar.core.plan import Plan

    return [f for f in dataclasses.fields(Plan) if f.name not in ("mesh", "rules")]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with [model], [train], [mesh], [plan] and [lora] tables; flags "
                                         "override it")
    parser.add_argument("--mesh", help="axis sizes (data=4,tensor=2; one may be -1), a .toml file, or a preset name in meshes/")
    parser.add_argument("--devices", type=int, default=None, help="host (CPU) devices to expose when no accelerator is used (default 8)")
    parser.add_argument("--gpu-flags", default="auto", choices=("auto", "none"),
                        help="auto: on NVIDIA GPUs, set the XLA flags that overlap communication with compute "
                             "(jaxpar.gpu_profile; a flag your XLA_FLAGS sets keeps your value); none: leave XLA_FLAGS as it is")
    for name, (kind, text) in TRAIN_FLAGS.items():
        if kind is bool:  # a switch
            parser.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", default=None, help=text)
        else:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    plan = parser.add_argument_group("plan", "how the step is laid out on the mesh")
    for field in _plan_fields():
        flag = "--" + field.name.replace("_", "-")
        text = field.metadata.get("help", "plan option")
        if isinstance(field.default, bool):
            plan.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:  # a tuple option is given as comma-separated text, which Plan reads
            kind = str if isinstance(field.default, tuple) else type(field.default)
            default = ",".join(field.default) if isinstance(field.default, tuple) else field.default
            plan.add_argument(flag, dest=field.name, type=kind, default=None, help=f"{text} (default {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxpar",
        description="Train and inspect Flax models with data, ZeRO, tensor, pipeline and expert parallelism.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (defaults: the tiny Llama on the built-in corpus)")
    _add_common(train)
    from jaxpar.run import grpo_command

    grpo_command.add_arguments(train)  # GRPO's own flags
    inspect = sub.add_parser("inspect", help="compile one step and report its collectives, memory and FLOPs")
    _add_common(inspect)
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    inspect.add_argument("--stages", type=int, default=None,
                         help="draw the --schedule timeline for this many pipeline stages (no model is compiled)")
    inspect.add_argument("--png", default=None, help="also draw the pipeline schedule into this PNG file")
    inspect.add_argument("--target", default=None, help=TARGET_HELP)
    export = sub.add_parser("export", help="write a checkpoint's parameters as one unsharded checkpoint")
    export.add_argument("--checkpoint-dir", required=True, help="a directory `jaxpar train --checkpoint-dir` wrote")
    export.add_argument("--out", required=True, help="a .npz file, or a directory for an Orbax checkpoint")
    export.add_argument("--step", type=int, default=None, help="the step to export (default: the newest)")
    export.add_argument("--format", choices=("jaxpar", "hf", "peft"), default="jaxpar",
                        help="jaxpar (.npz or Orbax, default), hf: a Hugging Face directory (safetensors), or peft: a "
                             "LoRA checkpoint's adapters as a PEFT adapter folder")
    export.add_argument("--merge", action="store_true",
                        help="--format hf of a LoRA checkpoint: write each adapted weight merged, W + (alpha / r) A B")
    export.add_argument("--dtype", default="float32", help="--format hf or peft: float32, bfloat16 or float16")
    export.add_argument("--devices", type=int, default=None,
                        help="host (CPU) devices to expose (default 8; `jaxpar launch` gives each process its own)")
    cli_weights.add_parsers(sub)
    launch = sub.add_parser("launch", help="run a jaxpar command, or any command (`-- python my_train.py ...`), as "
                                           "several cooperating processes on this machine",
                            epilog="a command that is not a jaxpar subcommand runs as it is, each rank told the job in "
                                   "its environment (jaxpar.distributed.initialize() reads it). "
                                   "exit code: 0 when every rank exited 0 (also after a forwarded SIGTERM/SIGINT whose "
                                   "save completed), else the failing rank's code, or 128+N when signal N killed it")
    launch.add_argument("--processes", "-n", type=int, default=2, help="number of processes")
    launch.add_argument("--devices-per-process", type=int, default=4, help="host devices each process exposes")
    launch.add_argument("--grace-s", type=float, default=30.0,
                        help="after a SIGTERM/SIGINT, seconds the ranks get to save and stop before SIGKILL (default 30; "
                             "after a death the others are ended at once)")
    launch.add_argument("--log-dir", default=None,
                        help="every rank's stdout/stderr as rankN.out/.err (default <checkpoint-dir>/logs when given)")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="after a death, start the job again (it resumes from --checkpoint-dir) up to N times")
    launch.add_argument("--heartbeat-s", type=float, default=None,
                        help="no step for S seconds (counted from the first step; start-up and compilation are not "
                             "timed) ends the job, naming the hung rank (default: 10x the slowest step, at least 60; "
                             "0: off)")
    launch.add_argument("--coordinator-port", type=int, default=None,
                        help="the port rank 0 serves jax.distributed's coordinator on (default: a free one)")
    launch.add_argument("--min-processes", type=int, default=None,
                        help="when a process cannot come back, restart on those left, down to M, with a smaller data "
                             "axis and more gradient accumulation (needs --max-restarts, or --shrink-to)")
    launch.add_argument("--shrink-to", type=int, metavar="N", default=None,
                        help="print the process count and the command to run on N of the -n processes (one argument a "
                             "line; shrunk as --min-processes would) and exit: a job script's smaller allocation")
    launch.add_argument("--status", metavar="LOGDIR", default=None,
                        help="print what happened to the launches logging to LOGDIR (its events.jsonl), then exit")
    launch.add_argument("rest", nargs=argparse.REMAINDER,
                        help="the command: a jaxpar subcommand (train --mesh data=8) or, after --, any command")
    _add_plan_command(sub)
    return parser


def _add_plan_command(sub) -> None:
    """`jaxpar plan`: rank layouts for a model on N devices by the analytic model (jaxpar.planner), no compile."""
    plan = sub.add_parser("plan", help="choose the layout for a model and a cluster: memory, traffic, bubble, "
                                       "step time and MFU predicted per layout (nothing is compiled)")
    plan.add_argument("--model", default="7b", help="model name (tiny, small, 1b, 7b, 8b, 70b, 405b, moe-tiny, ...)")
    plan.add_argument("--devices", type=int, default=None, help="number of accelerators in the cluster (default 8)")
    plan.add_argument("--device", default=None, help="h100 (default), h200, a100, tpu-v5p, cpu, or a device .toml file")
    plan.add_argument("--target", default=None, help="the cluster as a GPU target (h100x8, 2xh100x8, a target "
                                                     "config file: see inspect --target): its device, memory, "
                                                     "device and host counts, instead of --device/--devices/--hosts")
    plan.add_argument("--verify", type=int, nargs="?", const=3, default=0, metavar="N",
                      help="with --target: compile the top N layouts (default 3) for the target and print the "
                           "planner's memory per device beside the GPU compiler's, and whether it fits")
    plan.add_argument("--hosts", type=int, default=None, help="hosts the devices sit on (default: the device's node size)")
    plan.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    plan.add_argument("--batch-size", type=int, default=None, help="global batch in sequences (default: ~4M tokens)")
    plan.add_argument("--precision", default="bf16", help="fp32, bf16, fp16 or bf16-params")
    plan.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on a frozen base "
                                                                 "(0: every weight trains)")
    plan.add_argument("--lora-targets", default="q,k,v,o", help="the weights LoRA adapts (default q,k,v,o)")
    plan.add_argument("--base-dtype", default="none", help="with --lora-rank: the frozen layer-stack matrices held "
                                                           "as int8 or nf4 (QLoRA); none: in the parameter dtype")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan.add_argument("--explain", default=None, help='one layout\'s breakdown, e.g. "data=8,tensor=8,pipe=16 zero=1"')
    plan.add_argument("--json", action="store_true", help="also print everything as one JSON object on stdout")
    plan.add_argument("--png", default=None, help="write PREFIX_memory.png and PREFIX_scaling.png")
    plan.add_argument("--write-config", default=None, help="write the top layout as a `jaxpar train --config` TOML file")
    plan.add_argument("--scaling", choices=("weak", "strong"), default=None,
                      help="the planner's step time, communication share and efficiency over device counts (weak: "
                           "the sequences per device kept, --batch-size at the first count; strong: the global batch "
                           "kept; default: one sequence per device at the first / the last count); with --target (one host) the 1, 2 and 4-host counts are also compiled and their "
                           "collectives' bytes printed beside the planner's")
    plan.add_argument("--family", default="dp,zero3,3d", help="with --scaling: the layout families, of dp, zero3, 3d "
                                                              "(tensor=2 x pipe=2 x data), best (the planner's choice)")
    plan.add_argument("--counts", default=None, help="with --scaling: device counts (default 8,16,...,4096)")
    plan.add_argument("--plot", default=None, help="with --scaling: write efficiency against devices to this PNG")


def read_config(path: str | None) -> dict:
    """The --config file's tables, every table, [train] key and value type checked."""
    if not path:
        return {}
    if not os.path.exists(path):
        raise ValueError(f"--config {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--config {path!r} is not valid TOML: {error}") from None
    unknown = set(table) - set(CONFIG_TABLES)
    if unknown:
        raise ValueError(f"{path}: unknown tables {sorted(unknown)}; allowed: {', '.join(CONFIG_TABLES)}")
    for name, value in table.items():
        if not isinstance(value, dict):
            raise ValueError(f"{path}: {name} must be a table ([{name}]), got {value!r}")
    kinds = {**{name: kind for name, (kind, _) in TRAIN_FLAGS.items()}, "weight_decay": float, "clip": float}
    unknown_train = set(table.get("train", {})) - set(kinds)
    if unknown_train:
        raise ValueError(f"{path}: unknown [train] keys {sorted(unknown_train)}")
    for name, value in table.get("train", {}).items():
        _check_type(value, kinds[name], f"{path}: [train] {name}")
    return table


def _check_type(value, kind: type, where: str) -> None:
    """Refuse a TOML value of the wrong type (an int may stand for a float, a bool for nothing else)."""
    fits = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if not (fits or (kind is float and isinstance(value, int) and not isinstance(value, bool))):
        raise ValueError(f"{where} must be {'a' if kind is not int else 'an'} {kind.__name__}, got {value!r}")


def resolve(args: argparse.Namespace):
    """Merge built-in defaults, the --config file and flags into (TrainConfig, Plan options, mesh)."""
    from jaxpar.core.mesh import mesh_from_table, parse_mesh
    from jaxpar.run.training import TrainConfig

    table = read_config(args.config)
    model_table = dict(table.get("model", {}))
    train = {k: v for k, v in table.get("train", {}).items()}
    if "name" in model_table:
        train["model"] = model_table.pop("name")
    for name in TRAIN_FLAGS:
        if getattr(args, name) is not None:
            train[name] = getattr(args, name)
    if "steps" in train and "epochs" in train:
        steps, epochs = (f"--{k} {train[k]}" if getattr(args, k) is not None else f"[train] {k} = {train[k]} in "
                         f"{args.config}" for k in ("steps", "epochs"))
        raise ValueError(f"{steps} and {epochs} both set the run's length; give one: steps, or epochs (passes over "
                         "the data)")
    config = TrainConfig(**train, model_overrides=model_table)

    if args.mesh is not None:
        mesh, options = parse_mesh(args.mesh)
    elif "mesh" in table:
        mesh, options = mesh_from_table(table["mesh"], f"--config {args.config!r}"), {}
    else:
        import jax

        count = _target_devices(args) or jax.device_count()
        mesh, options = parse_mesh(DEFAULT_MESH if count == 8 else None)
    options = {**options, **table.get("plan", {}), **_lora_options(table, args.config)}
    if getattr(args, "target", None):
        options["target"] = args.target
    for field in _plan_fields():
        if field.name in table.get("plan", {}) and field.default is not None:
            value, kind = table["plan"][field.name], type(field.default)
            if kind is tuple:  # a list of names, or text like the flag's (the Plan checks the names)
                kind = list if isinstance(value, list) else str
            _check_type(value, kind, f"{args.config}: [plan] {field.name}")
        if getattr(args, field.name) is not None:
            options[field.name] = getattr(args, field.name)
    if config.adapter:  # the adapter's own rank, alpha and targets
        from jaxpar.interop.peft import adapter_options

        if not config.init_from:
            raise ValueError(f"--adapter {config.adapter} needs --init-from BASE: the base model the adapter is on")
        options = {**options, **adapter_options(config.adapter, options)}
    return config, options, mesh


def _lora_options(table: dict, path: str | None) -> dict:
    """A [lora] table's keys (rank, alpha, targets, dropout; base_dtype) as the plan's lora_* options (base_dtype as
    it is), type-checked."""
    lora = table.get("lora", {})
    unknown = set(lora) - set(LORA_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown [lora] keys {sorted(unknown)}; allowed: {', '.join(LORA_KEYS)}")
    option = {k: k if k == "base_dtype" else f"lora_{k}" for k in lora}
    twice = [k for k in lora if option[k] in table.get("plan", {})]
    if twice:
        raise ValueError(f"{path}: [lora] {twice[0]} and [plan] {option[twice[0]]} both set it; give one")
    kinds = {"rank": int, "alpha": float, "dropout": float, "base_dtype": str}
    for key, value in lora.items():
        if key == "targets":
            _check_type(value, list if isinstance(value, list) else str, f"{path}: [lora] targets")
        else:
            _check_type(value, kinds[key], f"{path}: [lora] {key}")
    return {option[k]: v for k, v in lora.items()}


def _target_name(args: argparse.Namespace) -> str | None:
    """The GPU target to compile for: --target, else the --config file's [plan] target (None: this machine)."""
    given = getattr(args, "target", None)
    if given is None and getattr(args, "config", None):
        given = read_config(args.config).get("plan", {}).get("target")
    return given


def _target_devices(args: argparse.Namespace) -> int | None:
    from jaxpar.core import target

    name = _target_name(args)
    if name is None:
        return None
    parsed = target.parse(name)
    return parsed.hosts * parsed.per_host


def _check_target(args: argparse.Namespace) -> None:
    """Refuse a target that cannot compile here in one line, before jax starts; keep jax off a GPU it would
    otherwise try to open (JAX_PLATFORMS=cpu unless the user set it)."""
    name = _target_name(args)
    if name is None:
        return
    if args.command not in ("inspect", "plan"):
        raise ValueError(f"target {name!r} compiles a step for other hardware and runs nothing: use `jaxpar inspect "
                         f"--target {name}` (or `jaxpar plan --target`), not `jaxpar {args.command}`")
    from jaxpar.core import target

    target.parse(name)
    missing = target.plugin_missing()
    if missing:
        raise ValueError(missing)
    if not os.environ.get("JAX_PLATFORMS"):  # read when jax was imported: set it in jax's config, before any backend
        import jax

        jax.config.update("jax_platforms", "cpu")


def _set_host_devices(count: int | None) -> None:
    """Expose `count` host devices (default 8, unless XLA_FLAGS already says); before jax starts."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if count is None or "host_platform_device_count" not in f]
    if not any("host_platform_device_count" in f for f in flags):
        flags.append(f"--xla_force_host_platform_device_count={8 if count is None else count}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _draw_schedule(args: argparse.Namespace, console, plan=None) -> int:
    """Draw a pipeline timeline: from --stages and the schedule flags, or from the plan being inspected."""
    from jaxpar.pipeline.schedule import Schedule
    from jaxpar.pipeline.schedule_pictures import render, save_png

    if plan is not None:
        schedule = Schedule(plan.schedule, plan.shape["pipe"], plan.pipeline_microbatches, plan.virtual_stages)
    else:
        defaults = {f.name: f.default for f in _plan_fields()}
        name = args.schedule or defaults["schedule"]
        schedule = Schedule(name, args.stages, args.microbatches or args.stages, args.virtual_stages or 1)
    console.print(render(schedule))
    if args.png:
        save_png(schedule, args.png)
        console.print(f"wrote {args.png}")
    if args.json and plan is None:
        print(json.dumps(schedule.summary()))
    return 0


def _subcommands() -> set[str]:
    """The names of jaxpar's own subcommands: what `jaxpar launch` runs through `python -m jaxpar.cli`."""
    return set(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices)


def _objective_run(args: argparse.Namespace, config, plan, console) -> int | None:
    """The exit code of an --objective grpo run (it samples its own batches), or None for next-token prediction and
    the preference objectives, whose run then goes on (GRPO's flags are refused there, ValueError)."""
    from jaxpar.run import grpo_command

    grpo_options = grpo_command.options(args)
    return None if grpo_options is None else grpo_command.train_with_progress(config, grpo_options, args, plan,
                                                                              console)


def _plan(args: argparse.Namespace) -> int:
    """`jaxpar plan`, with --verify's compiles for the --target (checked first: one line, exit 2)."""
    from jaxpar.planner.command import main as plan_main

    if args.scaling:
        from jaxpar.planner.scaling_command import main as scaling_main

        try:
            _check_target(args)  # --scaling --target compiles the whole-host counts
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        from jaxpar.run.verify import check_scaling_hosts

        return scaling_main(args, check_scaling_hosts)
    if args.plot or args.counts or args.family != "dp,zero3,3d":
        print("error: --family / --counts / --plot go with --scaling weak|strong", file=sys.stderr)
        return 2
    if not args.verify:
        return plan_main(args)
    try:
        if not args.target:
            raise ValueError("--verify compiles the top layouts for a GPU target: give --target (h100x8, ...)")
        _check_target(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from jaxpar.run.verify import verify

    return plan_main(args, verify)


def _inspect(run, args: argparse.Namespace, console) -> int:
    """Compile the run's step and print what it does; a refusal while tracing is one line (exit 2)."""
    from rich.console import Console
    from rich.markup import escape

    from jaxpar.run.report import print_inspection

    if run.plan.shape["pipe"] > 1 and (args.png or not args.json):
        _draw_schedule(args, console, run.plan)
    try:
        return print_inspection(run, console, as_json=args.json, gpu_flags=args.gpu_flags)
    except ValueError as error:  # refused while the step was traced (a forced kernel the model's calls rule out)
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2


def main(argv: list[str] | None = None) -> int:
    from jaxpar.core.spelling import as_flags
    from jaxpar.core.timeline import mark

    mark("cli")  # its imports done (benchmarks/restart.py)

    with as_flags():  # errors from the layers below name this command line's flags, not the API's arguments
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        from jaxpar.train.distributed import launch_local

        resume = ["jaxpar", *(sys.argv[1:] if argv is None else argv)]  # the same command resumes from --checkpoint-dir
        try:
            if args.status is not None:
                from jaxpar.train.launcher import status

                print(status(args.status))
                return 0
            if args.shrink_to is not None:
                from jaxpar.train.distributed import shrink_command

                print("\n".join(shrink_command(args.processes, args.rest, args.shrink_to, args.min_processes)))
                return 0
            command = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
            return launch_local(args.processes, args.devices_per_process, command, grace_s=args.grace_s,
                                log_dir=args.log_dir, max_restarts=args.max_restarts, resume=resume,
                                heartbeat_s=args.heartbeat_s, coordinator_port=args.coordinator_port,
                                min_processes=args.min_processes,
                                any_command=bool(command) and command[0] not in _subcommands())
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.command == "plan":
        return _plan(args)
    if args.command == "export" and args.format != "hf" and int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        print(f"error: export --format {args.format} is written by one process; only --format hf is written by "
              "several (`jaxpar launch`)", file=sys.stderr)
        return 2
    if args.command in cli_weights.HF_COMMANDS or (args.command == "export" and args.format != "jaxpar"):
        _set_host_devices(getattr(args, "devices", None))
        return cli_weights.run(args)
    if args.command == "export":
        _set_host_devices(args.devices)
        return cli_weights.export_weights(args)
    _set_host_devices(args.devices)
    try:
        _check_target(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from jaxpar.core import gpu_profile

    gpu_flags = gpu_profile.apply(args.gpu_flags)
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=args.command == "inspect" and args.json)
    if gpu_flags:
        console.print("[bold]GPU profile[/] XLA flags " + " ".join(f"--{k}={v}" for k, v in gpu_flags.items()))
    try:
        from jaxpar.train import distributed
        from jaxpar.train.launcher import RANK_OUTPUT_ENV
        if distributed.initialize() and not distributed.is_leader():
            console.quiet = RANK_OUTPUT_ENV not in os.environ  # the launcher keeps this rank's output in a log file
        from jaxpar.core.plan import Plan
        from jaxpar.run.training import prepare

        if args.command == "inspect" and args.stages is not None:
            return _draw_schedule(args, console)
        config, options, mesh = resolve(args)
        plan = Plan.create(mesh, **options)
        plan.check_batch(config.batch_size, config.seq_len)  # batch and sequence against the mesh, before any data
        if args.command == "train" and (code := _objective_run(args, config, plan, console)) is not None:
            return code
        if args.command == "inspect" and args.png and plan.shape["pipe"] == 1:
            raise ValueError("--png draws a pipeline schedule: give --stages N or a mesh with pipe > 1")
        run = prepare(config, plan)
    except ValueError as error:
        Console(stderr=True, quiet=console.quiet).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2
    if args.command == "train":
        from jaxpar.run.report import train_with_progress

        return train_with_progress(run, console)
    return _inspect(run, args, console)


if __name__ == "__main__":
    from jaxpar.train import ranks

    if ranks.SPARE_ENV in os.environ:  # started ahead of a restart by `jaxpar launch`: the rest of its imports too
        import jaxpar.run.report  # noqa: F401
        import jaxpar.run.training  # noqa: F401

        ranks.wait_if_spare()
    sys.exit(main())

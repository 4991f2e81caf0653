"""`jaxpar train --objective grpo`'s options and its run with a progress line, JSON lines and TensorBoard.

The command line's side of `jaxpar.run.grpo`: the flags (TRL's names where TRL has them), the options they make,
the flags of next-token training that cannot act on a GRPO run (refused), and the loop's output. Process 0 writes
each step's row (loss, rewards per function, KL, clip fractions, completion lengths) to `--metrics` and
`--tensorboard`; `--checkpoint-dir` saves every `--save-every` steps and at the end (a GRPO run does not resume).
"""

from __future__ import annotations

import argparse

from jaxpar.objectives import grpo
from jaxpar.objectives.grpo_step import GrpoOptions

# flags of next-token training on --data, and of the preference objectives, that a GRPO run has no use for
NOT_FOR_GRPO = ("data", "eval_every", "packing", "text_field", "epochs", "skip_bad_records", "adapter", "dpo_loss",
                "label_smoothing", "simpo_gamma", "sft_weight", "precompute_reference")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """GRPO's flags on `jaxpar train` (`--objective` and `--beta` are the common flags' own)."""
    group = parser.add_argument_group("grpo", "--objective grpo: reinforcement learning from rewards of sampled "
                                              "completions")
    group.add_argument("--prompts", default=None, help="grpo: JSON lines of {\"prompt\": text or chat messages, ...}; "
                                                       "the other fields go to the reward functions")
    group.add_argument("--reward", action="append", default=None,
                       help="grpo: a reward function, built-in (exact_answer, format) or module:function; repeatable "
                            "(their rewards add up)")
    group.add_argument("--group-size", type=int, default=None, help="grpo: completions per prompt, G (default 4); "
                                                                     "it must divide --batch")
    group.add_argument("--grpo-loss", choices=grpo.LOSS_TYPES, default=None,
                       help="grpo: the loss normalization, as TRL's loss_type (default dapo)")
    group.add_argument("--epsilon", type=float, default=None, help="grpo: the ratio's clip (default 0.2)")
    group.add_argument("--epsilon-high", type=float, default=None, help="grpo: the ratio's upper clip (default "
                                                                         "--epsilon)")
    group.add_argument("--grpo-iterations", type=int, default=None,
                       help="grpo: optimizer steps per generation batch (TRL's num_iterations; default 1)")
    group.add_argument("--temperature", type=float, default=None, help="grpo: sampling temperature (default 1)")
    group.add_argument("--top-p", type=float, default=None, help="grpo: nucleus sampling's mass (default 1)")
    group.add_argument("--max-new-tokens", type=int, default=None, help="grpo: completion length limit (default 32)")
    group.add_argument("--stop-token", type=int, action="append", default=None,
                       help="grpo: a token id that ends a completion; repeatable (default: the chat template's end "
                            "of turn, else the tokenizer's EOS)")
    group.add_argument("--no-scale-rewards", action="store_true", default=None,
                       help="grpo: advantages not divided by their group's std (Dr. GRPO)")
    group.add_argument("--mask-truncated", action="store_true", default=None,
                       help="grpo: completions cut at --max-new-tokens weigh nothing in the loss")


GRPO_FLAGS = ("prompts", "reward", "group_size", "grpo_loss", "epsilon", "epsilon_high", "grpo_iterations",
              "temperature", "top_p", "max_new_tokens", "stop_token", "no_scale_rewards", "mask_truncated")


def options(args: argparse.Namespace) -> GrpoOptions | None:
    """GRPO's options from the flags (None for another objective); a flag that cannot act is refused by name."""
    given = [f for f in GRPO_FLAGS if getattr(args, f, None) is not None]
    if args.objective != "grpo":
        if given:
            this = f"--objective {args.objective}" if args.objective else "next-token prediction"
            raise ValueError(f"--{given[0].replace('_', '-')} is a flag of --objective grpo (this run is {this})")
        return None
    unused = [f for f in NOT_FOR_GRPO if getattr(args, f, None) is not None]
    if unused:
        raise ValueError(f"--{unused[0].replace('_', '-')} has no use in --objective grpo, which trains on "
                         "completions sampled for --prompts")
    if not args.prompts:
        raise ValueError("--objective grpo needs --prompts (JSON lines of {\"prompt\": ...})")
    picked = {"group_size": args.group_size, "beta": args.beta, "loss_type": args.grpo_loss, "epsilon": args.epsilon,
              "epsilon_high": args.epsilon_high, "iterations": args.grpo_iterations, "temperature": args.temperature,
              "top_p": args.top_p, "max_new_tokens": args.max_new_tokens,
              "stop_tokens": tuple(args.stop_token) if args.stop_token else None,
              "scale_rewards": False if args.no_scale_rewards else None, "mask_truncated": args.mask_truncated}
    return GrpoOptions(**{k: v for k, v in picked.items() if v is not None})


def progress_line(row: dict) -> str:
    """One GRPO step as a line: loss, mean reward and its std, KL, clip fraction, completion length, gradient norm."""
    kl = f"  kl {row['kl']:.4g}" if "kl" in row else ""
    return (f"step {row['step']:>5}  loss {row['loss']:.6f}  reward {row['reward']:.4f} (std {row['reward_std']:.3f})"
            f"{kl}  clip {row['clip_ratio/region_mean']:.3f}  length {row['completions/mean_length']:.1f}  "
            f"grad_norm {row['grad_norm']:.4g}")


def train_with_progress(config, grpo_options: GrpoOptions, args: argparse.Namespace, plan, console) -> int:
    """Prepare (every check first), then train, printing a progress line every tenth of the run; 2 on bad input."""
    from rich.console import Console
    from rich.markup import escape

    from jaxpar.run.grpo import iterate_grpo, prepare_grpo
    from jaxpar.run.training import Outputs, open_checkpoints

    def refuse(error) -> int:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2

    try:
        grpo_run = prepare_grpo(config, grpo_options, args.prompts, args.reward or [], plan)
        checkpoints = open_checkpoints(grpo_run.run)
        if checkpoints is not None and checkpoints.latest_step() is not None:
            raise ValueError(f"--checkpoint-dir {config.checkpoint_dir} holds checkpoints: a GRPO run does not resume "
                             "yet; give a new directory")
    except ValueError as error:
        return refuse(error)
    console.print(f"[bold]grpo[/] {len(grpo_run.prompts.records)} prompts, {grpo_run.prompts_per_batch} x "
                  f"G={grpo_options.group_size} completions per generation batch, rewards "
                  f"{', '.join(name for name, _ in grpo_run.rewards)}, loss {grpo_options.loss_type}, "
                  f"beta {grpo_options.beta}")
    outputs = Outputs(config.metrics, config.tensorboard)
    log_every = max(1, config.steps // 10)
    rewards, state = [], None
    try:
        for state, row in iterate_grpo(grpo_run, grpo_run.run.init(), outputs.write):
            rewards.append(row["reward"])
            if row["step"] % log_every == 0 or row["step"] == 1:
                console.print(progress_line(row), soft_wrap=True)
            if checkpoints is not None and (row["step"] % config.save_every == 0 or row["step"] == config.steps):
                checkpoints.save(row["step"], state, force=True, metadata={"objective": "grpo"},
                                 model=grpo_run.run.model, optimizer=grpo_run.run.optimizer, plan=plan)
    except ValueError as error:  # a reward function that fails on a batch of the run
        return refuse(error)
    finally:
        outputs.close()
        if checkpoints is not None:
            checkpoints.wait()
    console.print(f"[bold green]done[/]: mean reward {rewards[0]:.4f} -> {rewards[-1]:.4f} over {len(rewards)} steps")
    return 0

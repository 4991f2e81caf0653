"""`jaxpar import-hf | export | eval | generate | tokenize`: the subcommands that read or write a model's weights.

`jaxpar.cli` adds their parsers (`add_parsers`) and hands them the parsed arguments (`run`, `export_weights`).
"""

from __future__ import annotations

import argparse
import json
import sys

HF_COMMANDS = ("import-hf", "eval", "generate", "tokenize")
# --compile-cache of train and inspect (jaxpar.cli) and of eval and generate (here)
COMPILE_CACHE_HELP = ("keep compiled steps in this directory, so that a restarted, resumed or repeated run loads "
                      "its step instead of compiling it; off: never (default: $JAXPAR_COMPILE_CACHE, else "
                      "~/.cache/jaxpar/xla)")


def export_weights(args: argparse.Namespace) -> int:
    """`jaxpar export` in jaxpar's own format (.npz or Orbax); one line and exit 2 on a bad checkpoint."""
    from jaxpar.interop.export import export

    try:
        if args.merge:
            raise ValueError("--merge writes merged full weights: give it with --format hf")
        summary = export(args.checkpoint_dir, args.out, args.step)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def add_parsers(sub) -> None:
    """`import-hf`, `eval`, `generate` and `tokenize` (jaxpar.interop.hf, .evaluate, .generate, .tokenize)."""
    imp = sub.add_parser("import-hf", help="convert a Hugging Face Llama (config.json + safetensors) to a jaxpar checkpoint")
    imp.add_argument("source", help="a local Hugging Face model directory, or a Hub repo id")
    imp.add_argument("--out", required=True, help="the directory to write (what --init-from, eval and generate read)")
    evaluate = sub.add_parser("eval", help="loss and perplexity of a checkpoint on the held-out 5%% of the data "
                              "(the tail; whole documents of a document source)")
    generate = sub.add_parser("generate", help="continue prompts: greedy or temperature/top-p sampling, KV cache")
    for command in (evaluate, generate):
        command.add_argument("--checkpoint-dir", required=True,
                             help="a training checkpoint directory, an export or import-hf directory, or a Hugging Face one")
        command.add_argument("--step", type=int, default=None, help="the training checkpoint step (default: the newest)")
        command.add_argument("--mesh", default=None, help="axis sizes, e.g. data=2,tensor=2 (default: one device)")
    evaluate.add_argument("--data", default=None, help="the text or token data whose held-out tail is evaluated")
    evaluate.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the model's, at most 256)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="windows per batch")
    evaluate.add_argument("--packing", default=None, help="documents or windows, as `jaxpar train --packing` "
                          "(default: documents for .jsonl, Parquet, datasets and text folders)")
    evaluate.add_argument("--skip-bad-records", action="store_true", help="evaluate without a document source's "
                          "bad records (as `jaxpar train --skip-bad-records`) instead of refusing the source")
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    generate.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; > 0 samples")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens up to this mass")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    generate.add_argument("--eos", type=int, default=None, help="token id that ends a sequence")
    generate.add_argument("--chat", action="store_true",
                          help="each prompt is a user message in the tokenizer's chat template; stop at its end of turn")
    generate.add_argument("--no-cache", action="store_true", help="recompute the whole sequence per token (reference)")
    tokenize = sub.add_parser("tokenize", help="text into a .npy token file (and a JSON header) for --data")
    tokenize.add_argument("source", help="a text file or a folder of text files")
    tokenize.add_argument("--out", required=True, help="the .npy file to write (its header goes beside it as .json)")
    tokenize.add_argument("--tokenizer", default=None,
                          help="a Hugging Face tokenizer.json or a SentencePiece .model (default: UTF-8 bytes)")
    for command in (evaluate, generate):
        command.add_argument("--tokenizer", default=None,
                             help="a Hugging Face tokenizer.json or a SentencePiece .model (default: UTF-8 bytes)")
    for command in (evaluate, generate):
        command.add_argument("--compile-cache", default=None, help=COMPILE_CACHE_HELP)
    for command in (imp, evaluate, generate):
        command.add_argument("--devices", type=int, default=None, help="host (CPU) devices to expose (default 8)")
        command.add_argument("--json", action="store_true", help="print one JSON object only")


def run(args: argparse.Namespace) -> int:
    """Run import-hf, export --format hf, eval, generate or tokenize; errors a person can act on exit with 2."""
    from rich.console import Console
    from rich.markup import escape

    try:
        if args.command == "tokenize":
            from jaxpar.data.tokenize import tokenize

            result = tokenize(args.source, args.out, args.tokenizer)
        elif args.command == "import-hf":
            from jaxpar.interop.hf import import_hf

            result = import_hf(args.source, args.out)
        elif args.command == "export" and args.format == "peft":
            from jaxpar.interop.peft import export_peft

            if args.merge:
                raise ValueError("--merge writes merged full weights: give it with --format hf (--format peft writes "
                                 "the adapter alone)")
            result = export_peft(args.checkpoint_dir, args.out, args.step, args.dtype)
        elif args.command == "export":
            from jaxpar.train import distributed

            distributed.initialize()  # under `jaxpar launch`, each process writes its share of the tensors
            from jaxpar.interop.hf_write import export_hf

            result = export_hf(args.checkpoint_dir, args.out, args.step, args.dtype, args.merge)
        elif args.command == "eval":
            from jaxpar.core import compile_cache
            from jaxpar.run.evaluate import evaluate_checkpoint
            from jaxpar.run.generate import generation_plan

            compile_cache.use(args.compile_cache)
            result = evaluate_checkpoint(args.checkpoint_dir, generation_plan(args.mesh), args.data, args.seq_len,
                                         args.batch_size, args.step, tokenizer=args.tokenizer, packing=args.packing,
                                         skip_bad_records=args.skip_bad_records)
        else:
            from jaxpar.core import compile_cache
            from jaxpar.run.generate import generate_from_checkpoint

            compile_cache.use(args.compile_cache)
            result = generate_from_checkpoint(
                args.checkpoint_dir, args.prompt, args.mesh, args.max_new_tokens, args.temperature, args.top_p,
                args.seed, args.eos, args.tokenizer, args.step, use_cache=not args.no_cache, chat=args.chat)
    except ValueError as error:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
        return 2
    if args.command == "generate" and not args.json:
        for prompt, text in zip(result["prompts"], result["completions"]):
            print(f"user: {prompt}\nassistant: {text}" if args.chat else f"{prompt}{text}")
        print(f"{result['new_tokens']} tokens in {result['generate_s']:.3f} s: {result['tokens_per_s']:.1f} tokens/s "
              f"(compile {result['compile_s']:.1f} s)", file=sys.stderr)
    else:
        print(json.dumps(result))
    return 0

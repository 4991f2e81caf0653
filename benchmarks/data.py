"""Data loader figures as JSON: the loader's tokens/s (the real path: windows of the stream, then host-to-device
global arrays) for a token file and a JSON lines source with 0, 1, 2 prefetch workers, against the tokens/s
the model's training step consumes, and the start-up time on a 1 GB token file.

    python benchmarks/data.py [--model small] [--batches 200] [--steps 3]
    python benchmarks/data.py --packed [--megabytes 200] [--batches 100]

`--packed` instead times packed documents (`--packing documents`) of a generated JSON lines file of
`--megabytes`: the start-up (from `prepare`'s start to its first batch read; the data part alone as
`data_s`) and the loader's tokens/s from step 0 of a fresh loader (blocks tokenized and packed as the
batches reach them) with 0, 1, 2 read-ahead workers.

The 1 GB file is written to a temporary folder and deleted afterwards; it was just written, so it is in
the page cache (a cold disk reads slower).
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.core.plan import Plan  # noqa: E402
from jaxpar.data.tokenize import training_streams  # noqa: E402
from jaxpar.run.training import TrainConfig, prepare  # noqa: E402
from jaxpar.data.tokens import Batches  # noqa: E402
from jaxpar.data.prefetch import prefetched  # noqa: E402

WORDS = "the of and a to in is was that for it with as on be by this are from at or an which".split()


def write_token_file(path: Path, gigabytes: float) -> None:
    """A .bin of uint16 ids below 256 (the small model's vocabulary), written in 64 MiB pieces."""
    rng, piece = np.random.default_rng(0), 32 * 2**20
    with path.open("wb") as f:
        for _ in range(int(gigabytes * 2**30) // (2 * piece)):
            f.write(rng.integers(0, 256, piece, dtype=np.uint16).tobytes())


def write_jsonl(path: Path, documents: int) -> None:
    rng = np.random.default_rng(1)
    with path.open("w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(50, 400))))}) + "\n")


def write_jsonl_bytes(path: Path, megabytes: float) -> int:
    """A JSON lines file of about `megabytes` of documents of 50 to 400 words; returns its documents."""
    rng, count = np.random.default_rng(1), 0
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, int(n)))}) + "\n" for n in rng.integers(50, 400, 4096)]
    with path.open("w") as f:
        while f.tell() < megabytes * 2**20:
            f.writelines(lines[i] for i in rng.permutation(len(lines)))
            count += len(lines)
    return count


def packed_figures(args, plan: Plan, shape: dict) -> dict:
    """Start-up and loader figures of packed documents from a generated JSON lines file (deleted afterwards)."""
    from jaxpar.data.packed import documents_of, packed_batches

    with tempfile.TemporaryDirectory() as folder:
        jsonl = Path(folder) / "docs.jsonl"
        documents = write_jsonl_bytes(jsonl, args.megabytes)
        config = TrainConfig(data=str(jsonl), packing="documents", **shape)
        began = time.perf_counter()
        run = prepare(config, plan)  # reads and checks batch 0
        prepare_s = time.perf_counter() - began
        vocab = run.model_config.vocab
        began = time.perf_counter()
        packed_batches(documents_of(config.data, None, vocab), config.batch_size, config.seq_len, config.seed, vocab,
                       config.data).rows(0)
        result = {"documents": documents, "bytes": jsonl.stat().st_size,
                  "startup_s": {"prepare_s": prepare_s, "data_s": time.perf_counter() - began}, "loader_tokens_per_s": {}}
        for workers in (0, 1, 2):
            run.batches = packed_batches(documents_of(config.data, None, vocab), config.batch_size, config.seq_len,
                                         config.seed, vocab, config.data)  # fresh: nothing packed yet
            result["loader_tokens_per_s"][f"workers={workers}"] = loader_rate(run, args.batches, workers, repeats=1)
    return result


def loader_rate(run, batches: int, workers: int, repeats: int = 3) -> float:
    """Tokens/s of `run.batch` (what the training loop calls) over `batches` steps, arrays on the devices.

    The best of `repeats` passes over the same steps (the first also pages in the windows it reads): the
    machine may be shared, and the best pass is the loader's own speed.
    """
    for batch in prefetched(run.batch, range(4), workers):  # warm: first transfers, threads
        jax.block_until_ready(batch)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for batch in prefetched(run.batch, range(4, 4 + batches), workers):
            jax.block_until_ready(batch)
        best = min(best, time.perf_counter() - began)
    return batches * run.config.batch_size * run.config.seq_len / best


def step_rate(run, steps: int) -> dict:
    """Tokens/s the training step consumes (compiled once, timed over `steps` after one warm step)."""
    state = run.init()
    began = time.perf_counter()
    compiled = run.step_fn.lower(state, run.batch(0)).compile()
    compile_s = time.perf_counter() - began
    batches = [run.batch(step) for step in range(steps + 1)]  # read beforehand: the step alone is timed
    state, metrics = compiled(state, batches[0])
    jax.block_until_ready(metrics)
    began = time.perf_counter()
    for batch in batches[1:]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    seconds = (time.perf_counter() - began) / steps
    return {"compile_s": compile_s, "step_time_s": seconds,
            "tokens_per_s": run.config.batch_size * run.config.seq_len / seconds}


def timed_prepare(config: TrainConfig, plan: Plan):
    """The prepared run, the seconds of `prepare` (everything but compiling) and of its data part alone."""
    began = time.perf_counter()
    run = prepare(config, plan)
    prepare_s = time.perf_counter() - began
    began = time.perf_counter()
    streams = training_streams(config.data, None, run.model_config.vocab, config.text_field)
    Batches(streams[0][1], config.batch_size, config.seq_len, config.seed, run.model_config.vocab).rows(0)
    return run, {"prepare_s": prepare_s, "data_s": time.perf_counter() - began}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--data", type=int, default=8, help="devices on the data axis")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200, help="batches read per loader figure")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed")
    parser.add_argument("--gigabytes", type=float, default=1.0, help="size of the start-up token file")
    parser.add_argument("--documents", type=int, default=20000, help="records of the JSON lines source")
    parser.add_argument("--packed", action="store_true", help="time packed documents of a generated .jsonl instead")
    parser.add_argument("--megabytes", type=float, default=200, help="size of the --packed JSON lines file")
    args = parser.parse_args()
    plan = Plan.create(f"data={args.data}", devices=jax.devices()[: args.data])
    shape = dict(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.batches + 8)
    result = {"benchmark": "data", "model": args.model, "mesh": f"data={args.data}", "batch_size": args.batch_size,
              "seq_len": args.seq_len, "backend": jax.default_backend(), "cpu_cores": os.cpu_count()}
    if args.packed:
        print(json.dumps({**result, "packed_jsonl": packed_figures(args, plan, shape)}, indent=1))
        return
    with tempfile.TemporaryDirectory() as folder:
        token_file, jsonl = Path(folder) / "tokens.bin", Path(folder) / "docs.jsonl"
        began = time.perf_counter()
        write_token_file(token_file, args.gigabytes)
        result["token_file"] = {"bytes": token_file.stat().st_size, "write_s": time.perf_counter() - began}
        run, startup = timed_prepare(TrainConfig(data=str(token_file), **shape), plan)
        result["token_file"]["startup_s"] = startup  # data_s: open, size checks, batch 0 read and checked
        result["token_file"]["loader_tokens_per_s"] = {f"workers={w}": loader_rate(run, args.batches, w)
                                                       for w in (0, 1, 2)}
        result["train_step"] = step_rate(run, args.steps)
        del run
        write_jsonl(jsonl, args.documents)
        run, startup = timed_prepare(TrainConfig(data=str(jsonl), packing="windows", **shape), plan)
        result["jsonl"] = {"documents": args.documents, "bytes": jsonl.stat().st_size,
                           "tokens": int(run.batches.tokens.size), "startup_s": startup,
                           "loader_tokens_per_s": {f"workers={w}": loader_rate(run, args.batches, w)
                                                   for w in (0, 1, 2)}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

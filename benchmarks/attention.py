"""Causal attention's memory and time by implementation and sequence length, on the current backend (issue 45).

For each sequence length and each implementation this backend can run —
`xla` (the textbook masked softmax, which keeps [seq, seq] scores: jaxpar's
attention before flash), `flash` (blockwise in XLA, jaxpar.parallel.attention_flash),
on NVIDIA GPUs `cudnn` (jax.nn.dot_product_attention) and `pallas`
(jaxpar.parallel.attention_pallas), on TPUs `splash` — the compiled
forward + backward's temp memory (XLA's memory analysis, no allocation) and,
where that fits the device, the median time of a forward + backward. Shapes
are a 1B model's attention layer (16 query heads, 8 key/value heads of 128),
batch 1; bf16 on a GPU, fp32 on the CPU. One JSON line per (seq, implementation),
then a summary line: flash's temp and time over xla's at each length.

    python benchmarks/attention.py                        # GPU: seq 1k-32k; CPU: seq 1k-4k
    python benchmarks/attention.py --seqs 1024,4096 --repeats 5 --blocks 512,512
    JAX_PLATFORMS=cpu python benchmarks/attention.py --target h100x8 --seqs 4096,8192

`--target NAME` (a GPU target, jaxpar.core.target: the CUDA plugin, no GPU) is the compile-only half: each
implementation compiled for one device of the target in bf16, with its temp memory, FLOPs (the module's
matmuls and fused-attention calls, jaxpar.planner.inspect.flops), the kernel found in the compiled module
and what `auto` picks there; nothing runs (`fwd_bwd_ms` null).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.parallel import attention_kernels, attention_pallas, attention_splash
from jaxpar.parallel.attention_flash import default_blocks, flash_attention
from jaxpar.parallel.attention_math import Scoring, attend


def implementations(dtype, head_dim: int) -> list[str]:
    """The implementations this backend runs for a plain causal call of `dtype` (each fused kernel where its
    refusal allows)."""
    call = attention_kernels.Call(dtype, head_dim, head_dim, False, Scoring(), 1)
    fused = {"cudnn": attention_kernels.cudnn_refusal, "pallas": attention_pallas.pallas_refusal,
             "splash": attention_splash.splash_refusal}
    return ["xla", "flash"] + [name for name, refusal in fused.items() if refusal(call) is None]


def attention_fn(name: str, seq: int, blocks):
    pos = np.arange(seq)
    if name == "xla":
        return lambda q, k, v: attend(q, k, v, jnp.asarray(pos), jnp.asarray(pos), Scoring())
    if name == "flash":
        return lambda q, k, v: flash_attention(q, k, v, pos, pos, Scoring(), blocks=blocks)[0]
    if name == "pallas":
        return lambda q, k, v: attention_pallas.pallas_attention(q, k, v, Scoring())
    if name == "splash":
        return lambda q, k, v: attention_splash.splash_attention(q, k, v, Scoring())
    return lambda q, k, v: attention_kernels.cudnn(q, k, v, Scoring())


def free_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# what the compiled module hands to a library or a kernel of its own, by custom-call target
KERNELS = (("__cudnn$fmha", "cudnn"), ("__gpu$xla.gpu.triton", "triton"), ("tpu_custom_call", "mosaic"))


def kernels_in(compiled) -> list[str]:
    text = compiled.as_text()
    return [name for target, name in KERNELS if target in text]


def compile_only(name: str, seq: int, args, dtype, plan) -> dict:
    """One implementation compiled for the target's device under `plan` (its facts decide every kernel's
    refusal and flash's blocks): temp memory, FLOPs, the kernels in the module; nothing runs."""
    from jaxpar.planner.inspect import flops

    with plan.activate():
        shape_q, shape_kv = (1, seq, args.heads, args.head_dim), (1, seq, args.kv_heads, args.head_dim)
        fn = attention_fn(name, seq, attention_kernels.parse_blocks(args.blocks) if args.blocks else default_blocks())
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
        sharding = plan.sharding(jax.sharding.PartitionSpec())
        abstract = [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in (shape_q, shape_kv, shape_kv)]
        start = time.perf_counter()
        compiled = step.lower(*abstract).compile()
        call = attention_kernels.Call(dtype, args.head_dim, args.head_dim, False, Scoring(), 1)
        auto = attention_kernels.choose(call)[0]
    device, kernels = plan.mesh.devices.flat[0], kernels_in(compiled)
    note = {"flops_note": "a Triton kernel's FLOPs are not counted"} if "triton" in kernels else {}
    return {"seq": seq, "implementation": name, "compile_s": round(time.perf_counter() - start, 2),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "flops": flops(compiled),
            "kernels": kernels, "auto_picks": auto, **note, "target": args.target,
            "device": device.device_kind, "dtype": jnp.dtype(dtype).name, "fwd_bwd_ms": None,
            "why": "compile-only target: nothing runs"}


def measure(name: str, seq: int, args, dtype) -> dict:
    shape_q, shape_kv = (1, seq, args.heads, args.head_dim), (1, seq, args.kv_heads, args.head_dim)
    fn = attention_fn(name, seq, attention_kernels.parse_blocks(args.blocks) if args.blocks else default_blocks())
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    abstract = [jax.ShapeDtypeStruct(s, dtype) for s in (shape_q, shape_kv, shape_kv)]
    start = time.perf_counter()
    compiled = step.lower(*abstract).compile()
    row = {"seq": seq, "implementation": name, "compile_s": round(time.perf_counter() - start, 2),
           "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "dtype": jnp.dtype(dtype).name}
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [jax.random.normal(key, s.shape, dtype) for key, s in zip(keys, abstract)]
    if row["temp_bytes"] > 0.8 * free_bytes():
        return {**row, "fwd_bwd_ms": None, "why": "its temp memory does not fit this device"}
    jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    return {**row, "fwd_bwd_ms": round(1e3 * statistics.median(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = jax.default_backend() == "gpu"
    parser.add_argument("--seqs", default=None, help="sequence lengths (default: 1k-32k on a GPU or a --target, "
                                                     "1k-4k on the CPU)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5 if gpu else 2)
    parser.add_argument("--blocks", default="", help="flash attention's Q,K block lengths (default: the backend's)")
    parser.add_argument("--target", default=None, help="compile only, for one device of this GPU target (h100x8, "
                                                           "...: needs the CUDA plugin and JAX_PLATFORMS=cpu)")
    args = parser.parse_args()
    plan = None
    if args.target:
        from jaxpar.core import target
        from jaxpar.core.plan import Plan

        try:
            plan = Plan.create("data=1", devices=target.one_device(args.target))
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    dtype = jnp.bfloat16 if gpu or plan is not None else jnp.float32
    args.seqs = args.seqs or ("1024,2048,4096,8192,16384,32768" if gpu or plan is not None else "1024,2048,4096")
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        with plan.activate() if plan is not None else contextlib.nullcontext():
            names = implementations(dtype, args.head_dim)
        for name in names:
            rows.append(compile_only(name, seq, args, dtype, plan) if plan is not None
                        else measure(name, seq, args, dtype))
            print(json.dumps(rows[-1]), flush=True)
    by = {(r["seq"], r["implementation"]): r for r in rows}
    summary = {}
    for seq in sorted({r["seq"] for r in rows}):
        xla, flash = by[(seq, "xla")], by[(seq, "flash")]
        time_ratio = (flash["fwd_bwd_ms"] / xla["fwd_bwd_ms"]) if xla["fwd_bwd_ms"] and flash["fwd_bwd_ms"] else None
        summary[seq] = {"flash_temp_over_xla": round(flash["temp_bytes"] / max(xla["temp_bytes"], 1), 4),
                        "flash_time_over_xla": None if time_ratio is None else round(time_ratio, 3)}
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()

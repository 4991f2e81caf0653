"""A complete training script for a model of one's own: jaxpar's data, checkpoints, inspection and metrics.

The model is written here, in Flax NNX, from jaxpar's public layers (so every plan applies to it: ZeRO,
tensor and sequence parallelism, context parallelism). It trains on a JSON lines file packed as documents
(each document attends only to itself, its positions restart, padding weighs nothing), saves a checkpoint
every `--save-every` steps with the data stream's position, resumes exactly from the newest one, prints the
compiled step's collectives and memory once, and writes each step's figures as `jaxpar train` does.

    python examples/train_loop.py --data docs.jsonl --steps 100 --checkpoint-dir ck
    jaxpar launch -n 2 --devices-per-process 4 -- python examples/train_loop.py --data docs.jsonl --checkpoint-dir ck

SIGTERM (a scheduler's preemption notice, or `jaxpar launch` passing one on) saves the step every process
agrees on and exits 0; the same command resumes from it.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxpar
import jaxpar.distributed
import jaxpar.inspect
from jaxpar.checkpoint import Checkpoints
from jaxpar.metrics import Metrics

VOCAB, D_MODEL, HEADS, HEAD_DIM, D_FF, LAYERS = 256, 64, 4, 16, 128, 2  # bytes in, a small transformer
Q_NAMES = ("batch", "seq", "heads", "head_dim")


def param(rngs, shape, names, scale=None):
    """A weight with the logical names of its dimensions (the plan maps them onto mesh axes)."""
    init = nnx.initializers.ones_init() if scale is None else nnx.initializers.normal(scale)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))


def rms_norm(x, weight):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6) * weight


def rotary(x, positions):
    """Rotary embeddings at `positions` ([seq], or [batch, seq] for packed documents) on [batch, seq, heads, dim]."""
    half = x.shape[-1] // 2
    angles = positions[..., None].astype(jnp.float32) * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if angles.ndim == 2:  # shared by the batch
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None], sin[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    """Pre-norm attention and a gated MLP; each is one column-parallel -> row-parallel pair over `tensor`."""

    def __init__(self, rngs: nnx.Rngs):
        d, h, k, f = D_MODEL, HEADS, HEAD_DIM, D_FF
        self.attn_norm, self.mlp_norm = param(rngs, (d,), ("norm",)), param(rngs, (d,), ("norm",))
        self.wq, self.wk, self.wv = (param(rngs, (d, h, k), ("embed", "heads", "head_dim"), d**-0.5) for _ in range(3))
        self.wo = param(rngs, (h, k, d), ("heads", "head_dim", "embed"), (h * k) ** -0.5 / 2)
        self.w_gate, self.w_up = (param(rngs, (d, f), ("embed", "mlp"), d**-0.5) for _ in range(2))
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), f**-0.5 / 2)

    def __call__(self, x):
        h = jaxpar.enter_tensor_region(rms_norm(x, self.attn_norm[...]))
        q, k, v = jaxpar.column_parallel(h, (self.wq[...], self.wk[...], self.wv[...]), "bsd,dhk->bshk",
                                         (Q_NAMES, Q_NAMES, Q_NAMES))
        positions = jaxpar.token_positions(x.shape[1])  # each document's own, when the rows are packed
        out = jaxpar.causal_attention(rotary(q, positions), rotary(k, positions), v)  # within each document
        x = x + jaxpar.row_parallel(out, self.wo[...], "bshk,hkd->bsd", Q_NAMES)
        h = jaxpar.enter_tensor_region(rms_norm(x, self.mlp_norm[...]))
        gate, up = jaxpar.column_parallel(h, (self.w_gate[...], self.w_up[...]), "bsd,df->bsf", ("batch", "seq", "mlp"))
        return x + jaxpar.row_parallel(jax.nn.silu(gate) * up, self.w_down[...], "bsf,fd->bsd", ("batch", "seq", "mlp"))


class TinyLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embedding = param(rngs, (VOCAB, D_MODEL), ("vocab", "embed"), 1.0)
        self.blocks = jaxpar.Stack(Block, LAYERS, rngs=rngs)  # one scan over the layers: ZeRO gathers per layer
        self.final_norm = param(rngs, (D_MODEL,), ("norm",))
        self.head = param(rngs, (D_MODEL, VOCAB), ("embed", "vocab"), D_MODEL**-0.5)

    def __call__(self, batch):
        """The mean next-token loss; packed documents' loss weights are applied by the cross-entropy."""
        x = self.blocks(jaxpar.embedding_lookup(batch["inputs"], self.embedding[...]))
        return jaxpar.vocab_parallel_cross_entropy(rms_norm(x, self.final_norm[...]), self.head[...], batch["targets"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a JSON lines file of documents ({'text': ...} per line)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--mesh", default=None, help="e.g. data=4,tensor=2 (default: data over every device)")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--metrics", default=None, help="write each step's figures here as JSON lines")
    args = parser.parse_args(argv)

    jaxpar.distributed.initialize()  # under `jaxpar launch`, Slurm or a TPU pod: join the job; alone: nothing
    plan = jaxpar.Plan.create(args.mesh or f"data={jax.device_count()}", zero=args.zero)
    optimizer = optax.adamw(1e-3)
    model, state = jaxpar.init_state(lambda: TinyLM(nnx.Rngs(0)), optimizer, plan)
    train_step = jaxpar.make_train_step(model, lambda m, batch: m(batch), optimizer, plan)
    spec = jaxpar.DataSpec(data=args.data, packing="documents")
    stream = jaxpar.batch_stream(spec, plan, args.batch_size, args.seq_len, VOCAB)  # checked before compiling

    with Checkpoints(args.checkpoint_dir, model, optimizer, plan, save_every=args.save_every) as checkpoints:
        if checkpoints.latest_step() is not None:
            state, data_state = checkpoints.restore()  # onto this plan, whatever plan saved it
            stream.set_state(data_state)
        start = int(state.step)
        if start == 0 and jaxpar.distributed.is_leader():
            jaxpar.inspect.show(jaxpar.inspect.inspect_step(train_step, state, stream.batch(0)))
        with Metrics(args.metrics, start=start, print_every=1,
                     tokens_per_step=args.batch_size * args.seq_len) as metrics:
            for step in range(start, args.steps):
                began = time.perf_counter()
                state, out = train_step(state, next(stream))
                loss = float(out["loss"])  # waits for the step
                metrics.write({"step": step + 1, "loss": loss, "step_time_s": time.perf_counter() - began})
                checkpoints.save(step + 1, state, data_state=stream.get_state())
                if checkpoints.reached_preemption(step + 1):  # SIGTERM: saved above, now stop
                    break
        checkpoints.wait_until_finished()
    if jaxpar.distributed.is_leader():
        print(json.dumps({"done": int(state.step), "loss": loss if start < args.steps else None}))


if __name__ == "__main__":
    main()

"""The miniGPT of the JAX AI stack tutorial "Train a miniGPT language model with JAX", on jaxpar.

Changes against the tutorial's model: each annotation `NamedSharding(mesh,
P(...))` becomes the tuple of names inside it (`model` is a logical name the
plan maps onto `tensor`, RULES; the two rank-2 names the tutorial gives rank-1
arrays become rank 1); the list of blocks becomes a `jaxpar.Stack`; the loss
goes through `jaxpar.pipelined_loss`, so that `pipe=2` runs the blocks as a
pipeline; and attention has no biases, since the key's gets no gradient
(softmax ignores a shift) and Adam would turn its round-off into full steps.
The pipelined model holds parameters only: dropout stays off, as the tutorial
trains it (`training=False`; a pipeline stage cannot carry RNG streams). The
MoE variant (`MoEMiniGPT`: the FFN replaced by `jaxpar.moe_ffn`, run on
`data=2,expert=4`) calls its Stack directly, without the pipeline.

    python examples/minigpt.py --mesh data=2,tensor=2,pipe=2 [--zero 3] [--moe]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar

RULES = {"model": "tensor"}  # the tutorial's `model` axis, as a logical name
# The tutorial: vocab 50257 (GPT-2), maxlen 256, embed 256, 8 heads, FFN 256, 8 blocks, batch 256.
vocab_size, maxlen, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks, batch_size = 64, 16, 32, 4, 64, 2, 16
MOE = jaxpar.MoEConfig(n_experts=4, top_k=2, dropless=True)


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))

class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads,
                                          in_features=embed_dim,
                                          kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model')),
                                          use_bias=False,  # a key bias gets no gradient: softmax ignores a shift
                                          rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6,
                                         num_features=embed_dim,
                                         scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ('model',)),
                                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('model',)),
                                         rngs=rngs)
        self.linear1 = nnx.Linear(in_features=embed_dim,
                                  out_features=ff_dim,
                                  kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model')),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('model',)),
                                  rngs=rngs)
        self.linear2 = nnx.Linear(in_features=ff_dim,
                                  out_features=embed_dim,
                                  kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model')),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('model',)),
                                  rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate)
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6,
                                         num_features=embed_dim,
                                         scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ('model',)),
                                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('model',)),
                                         rngs=rngs)


    def __call__(self, inputs, training: bool = False):
        input_shape = inputs.shape
        _, seq_len, _ = input_shape

        mask = causal_attention_mask(seq_len)

        attention_output = self.mha(
            inputs_q=inputs,
            mask=mask,
            decode=False
        )
        attention_output = self.dropout1(attention_output, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention_output)

        ffn_output = self.linear1(out1)
        ffn_output = nnx.relu(ffn_output)
        ffn_output = self.linear2(ffn_output)
        ffn_output = self.dropout2(ffn_output, deterministic=not training)

        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x)
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    block = TransformerBlock

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int, num_transformer_blocks: int, rngs: nnx.Rngs):
        self.embedding_layer = TokenAndPositionEmbedding(
                    maxlen, vocab_size, embed_dim, rngs=rngs
                )
        self.transformer_blocks = jaxpar.Stack(lambda rngs: self.block(
            embed_dim, num_heads, feed_forward_dim, rngs=rngs
        ), num_transformer_blocks, rngs=rngs)

        self.output_layer = nnx.Linear(in_features=embed_dim,
                                       out_features=vocab_size,
                                       kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), (None, 'model')),
                                       bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ('model',)),
                                       rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x, training=training)
        outputs = self.output_layer(x)
        return outputs

    def loss(self, inputs, targets):
        """Mean cross-entropy of the next tokens: a pipeline over `pipe` when the plan has one."""
        return jaxpar.pipelined_loss(
            self, self.transformer_blocks, lambda m, tokens: m.embedding_layer(tokens),
            lambda m, x, labels: optax.softmax_cross_entropy_with_integer_labels(m.output_layer(x), labels).mean(),
            inputs, targets)


class MoETransformerBlock(TransformerBlock):
    """The tutorial's block with its FFN replaced by `jaxpar.moe_ffn`: a router and MOE.n_experts SwiGLU experts.

    Returns (x, this layer's routing statistics); the Stack stacks them per layer.
    """

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        super().__init__(embed_dim, num_heads, ff_dim, rngs=rngs, rate=rate)
        del self.linear1, self.linear2
        init, e = nnx.initializers.xavier_uniform(batch_axis=(0,)), MOE.n_experts
        self.router = nnx.Param(nnx.initializers.xavier_uniform()(rngs.params(), (embed_dim, e)),
                                out_sharding=('embed', None))
        hidden = ('experts', 'embed', 'expert_mlp')
        self.expert_gate = nnx.Param(init(rngs.params(), (e, embed_dim, ff_dim)), out_sharding=hidden)
        self.expert_up = nnx.Param(init(rngs.params(), (e, embed_dim, ff_dim)), out_sharding=hidden)
        self.expert_down = nnx.Param(init(rngs.params(), (e, ff_dim, embed_dim)),
                                     out_sharding=('experts', 'expert_mlp', 'embed'))

    def __call__(self, inputs, training: bool = False):
        mask = causal_attention_mask(inputs.shape[1])
        attention_output = self.dropout1(self.mha(inputs_q=inputs, mask=mask, decode=False), deterministic=not training)
        out1 = self.layer_norm1(inputs + attention_output)
        experts = {k: getattr(self, k)[...] for k in ('router', 'expert_gate', 'expert_up', 'expert_down')}
        ffn_output, stats = jaxpar.moe_ffn(experts, out1, MOE)
        return self.layer_norm2(out1 + self.dropout2(ffn_output, deterministic=not training)), stats


class MoEMiniGPT(MiniGPT):
    """MiniGPT on MoE blocks: the loss adds the routers' load-balancing losses (summed over the layers)."""

    block = MoETransformerBlock

    def loss(self, inputs, targets):
        x, stats = self.transformer_blocks(self.embedding_layer(inputs))
        ce = optax.softmax_cross_entropy_with_integer_labels(self.output_layer(x), targets).mean()
        return ce + stats["load_balance_loss"].sum(), {"ce_loss": ce, "dropped_fraction": stats["dropped_fraction"].mean()}


def make_model(moe: bool = False):
    cls = MoEMiniGPT if moe else MiniGPT
    return cls(maxlen, vocab_size, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks, rngs=nnx.Rngs(0))


def make_optimizer():
    return optax.adam(1e-3)


def loss_fn(model, batch):
    return model.loss(batch[0], batch[1])


prep_target_batch = jax.vmap(lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0]))))


def batches(steps: int):
    """Synthetic token batches (input, target): runs counting up from a random token, shifted as the tutorial does."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        first = rng.integers(1, vocab_size, (batch_size, 1))
        input_batch = ((first + np.arange(maxlen)) % vocab_size).astype(np.int32)
        out.append((input_batch, np.asarray(prep_target_batch(input_batch))))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=4,tensor=2")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--moe", action="store_true", help="the MoE variant (e.g. --mesh data=2,expert=4)")
    args = parser.parse_args(argv)
    plan = jaxpar.Plan.create(args.mesh, zero=args.zero, rules=RULES)
    model, state = jaxpar.init_state(lambda: make_model(args.moe), make_optimizer(), plan)
    step = jaxpar.make_train_step(model, loss_fn, make_optimizer(), plan)
    for i, batch in enumerate(batches(args.steps)):
        state, metrics = step(state, batch)
        print(f"step {i}: loss {float(metrics['loss']):.6f}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # 8 CPU devices where there is no accelerator
    main()

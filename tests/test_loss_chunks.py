"""The cross-entropy over chunks of tokens: the compiled step drops the whole logits, the auto choice, bad counts.

Equivalence with the plain-JAX reference under every form that splits the sequence (ZeRO-3, tensor in both
forms with sequence parallelism, the context ring, a pipeline) is in tests/test_packing.py's mesh list, on
packed documents with loss weights.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jaxpar.core.plan import Plan
from jaxpar.core.usage import PlanOptionUnused
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.parallel import loss_chunks
from jaxpar.train.state import init_state
from jaxpar.train.step import make_train_step

# a vocabulary-heavy model: the logits (8 rows x 256 x 8192 fp32 = 32 MiB per device at data=2) dwarf the rest
CONFIG = LlamaConfig(vocab=8192, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, seq_len=256)
ROWS = 8
LOGITS = 4 * (ROWS // 2) * CONFIG.seq_len * CONFIG.vocab


def compiled_step(chunks: int):
    plan = Plan.create("data=2", devices=jax.devices()[:2], loss_chunks=chunks)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optax.sgd(0.1), plan)
    batch = {k: jnp.zeros((ROWS, CONFIG.seq_len), jnp.int32) for k in ("inputs", "targets")}
    return make_train_step(model, lambda m, b: m(b), optax.sgd(0.1), plan).lower(state, batch)


def test_chunks_keep_one_chunks_logits_and_gradient_alive_not_the_whole_sequences():
    whole = compiled_step(1).compile().memory_analysis().temp_size_in_bytes
    chunked = compiled_step(8).compile().memory_analysis().temp_size_in_bytes
    print(f"temp: whole logits {whole / 2**20:.1f} MiB, 8 chunks {chunked / 2**20:.1f} MiB, "
          f"logits {LOGITS / 2**20:.0f} MiB")
    assert chunked <= whole - 2 * LOGITS * (1 - 1 / 8)  # the logits and their gradient, less one chunk's


def test_auto_takes_the_fewest_chunks_that_divide_the_positions_and_fit_the_budget():
    budget_tokens = loss_chunks.AUTO_CHUNK_BYTES // (4 * 32000)
    assert loss_chunks.pick(1, 512, 32000) == 1  # 62.5 MiB of logits: one chunk
    assert loss_chunks.pick(1, 4096, 32000) == 4  # 500 MiB: 1,024 tokens a chunk
    assert 4096 // 4 <= budget_tokens < 4096 // 3
    assert loss_chunks.pick(1, 4095, 32000) == 5  # 4 does not divide 4,095 positions: the next that does
    assert loss_chunks.pick(1, 4093, 32000) == 1  # a prime: no chunk of >= 256 tokens divides it
    assert loss_chunks.pick(1, 2**20, 4096) == 128  # 16 GiB of logits: 128 chunks of 8,192 tokens
    assert loss_chunks.pick(1, 2**20, 128256) == 4096  # 500 GiB: not finer than 256 tokens, over budget
    assert loss_chunks.pick(2, 8192, 128256) == 64  # Llama 3's vocabulary: 8.0 GiB of logits


def test_a_count_that_does_not_divide_the_positions_is_refused_while_tracing():
    with pytest.raises(ValueError, match=r"loss_chunks=3 must divide each device's 256 sequence positions "
                                         r"\(the sequence's 256 positions split over 1 device"):
        compiled_step(3)


def test_a_negative_count_is_refused_by_the_plan():
    with pytest.raises(ValueError, match="loss_chunks must be >= 1, or 0"):
        Plan.create("data=2", devices=jax.devices()[:2], loss_chunks=-1)


def test_chunks_asked_of_a_model_without_jaxpars_loss_are_warned_about():
    plan = Plan.create("data=2", devices=jax.devices()[:2], loss_chunks=4)
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optax.sgd(0.1), plan)
    batch = {k: jnp.zeros((ROWS, CONFIG.seq_len), jnp.int32) for k in ("inputs", "targets")}
    own_loss = lambda m, b: jnp.mean(m.embed(b["inputs"]) ** 2)  # noqa: E731 - no cross-entropy of jaxpar's
    with pytest.warns(PlanOptionUnused, match="loss_chunks=4 has no effect"):
        make_train_step(model, own_loss, optax.sgd(0.1), plan).lower(state, batch)

"""The built-in models as building blocks: built and run outside any plan, they are plain single-device code.

Flax applies a parameter's sharding names itself unless told not to; the models' parameters carry logical names
for the plan only, so `Llama(LlamaConfig(...), nnx.Rngs(0))` needs no mesh, and its loss and logits match the
plain JAX reference (tests/reference.py) on the same parameters.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import reference
from jaxpar.models.inference import init_cache
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.models.moe import MoeLlama, MoeLlamaConfig


def _batch(vocab: int, shape=(2, 16)) -> dict:
    tokens = np.random.default_rng(0).integers(0, vocab, (shape[0], shape[1] + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _relative(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_llama_outside_a_plan_is_the_reference_model():
    cfg = LlamaConfig(vocab=1000, n_layers=2)
    model = Llama(cfg, nnx.Rngs(0))  # no plan, no mesh, no use_eager_sharding
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert all(leaf.sharding.num_devices == 1 for leaf in jax.tree.leaves(params))
    batch = _batch(cfg.vocab)
    loss, _ = model(batch)
    expected, _ = reference.llama_loss(params, batch, cfg)
    assert _relative(loss, expected) < 1e-5
    logits = model.logits(jnp.asarray(batch["inputs"]))
    assert logits.shape == (2, 16, cfg.vocab)
    picked = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    from_logits = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) - picked)
    assert _relative(from_logits, expected) < 1e-5

    # the README's KV-cache decode: a prompt, then one token at a time, gives the logits of the whole sequence
    tokens = jnp.asarray(batch["inputs"])
    cache = init_cache(cfg, batch=2, slots=16)
    prompt_logits, cache = model.decode(tokens[:, :12], cache)
    stepped = [prompt_logits]
    for i in range(12, 16):
        one, cache = model.decode(tokens[:, i:i + 1], cache)
        stepped.append(one)
    assert _relative(jnp.concatenate(stepped, axis=1), logits) < 1e-5


def test_moe_llama_outside_a_plan_is_the_reference_model():
    cfg = MoeLlamaConfig(vocab=512, n_layers=2, n_experts=4, top_k=2, moe_every=1)  # logits: every block MoE
    model = MoeLlama(cfg, nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    batch = _batch(cfg.vocab)
    loss, _ = model(batch)
    expected, _ = reference.moe_loss(params, batch, cfg)
    assert _relative(loss, expected) < 1e-5
    assert model.logits(jnp.asarray(batch["inputs"])).shape == (2, 16, cfg.vocab)

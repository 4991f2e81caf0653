"""`jaxpar.sample` on a training plan equals greedy decoding of each prompt alone on one device.

The reference re-runs the whole sequence per token (no cache, no padding, no batch) and stops at the first stop
token; the sampler decodes prompts x G rows with the KV cache on the parameters as `init_state` shards them for
training (data=8: rows padded up to the batch ways; data=4,tensor=2), LoRA adapters folded per layer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.core.plan import Plan
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.train.state import init_state

CFG = LlamaConfig(vocab=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=32)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43]]
G, NEW = 2, 6


def plan_of(mesh: str, **options) -> Plan:
    spec, parsed = jaxpar.parse_mesh(mesh)
    devices = jax.devices()[: int(np.prod(list(spec.shape.values())))]
    return Plan.create(spec, devices=devices, **{**parsed, **options})


def make_model():
    return Llama(CFG, nnx.Rngs(0))


def folded(params) -> dict:
    """The plain model's parameters: each adapted W + scale x A B, in numpy (no jaxpar code)."""
    blocks = {k: np.asarray(v) for k, v in params["blocks"].items()}
    out = {k: v for k, v in blocks.items() if "_lora_" not in k}
    for name in [k for k in blocks if k + "_lora_a" in blocks]:
        w, a, b, scale = (blocks[name + s] for s in ("", "_lora_a", "_lora_b", "_lora_scale"))
        n, r = a.shape[0], a.shape[-1]
        delta = np.matmul(a.reshape(n, -1, r), b.reshape(n, r, -1)) * scale.reshape(n, 1, 1)
        out[name] = w + delta.reshape(w.shape)
    return {**{k: np.asarray(v) for k, v in params.items() if k != "blocks"}, "blocks": out}


def reference(params) -> list[list[int]]:
    """Each prompt alone, greedy, whole sequence re-run per token (each row G times)."""
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(make_model())
    nnx.replace_by_pure_dict(state, folded(params))
    model = nnx.merge(graphdef, state)
    width = max(map(len, PROMPTS)) + NEW
    # the whole sequence, right-padded to one width (the model is causal: what follows a position never reaches it)
    last = jax.jit(lambda seq, n: jnp.argmax(model.logits(seq)[0, n - 1]))
    out = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW):
            seq.append(int(last(jnp.asarray([seq + [0] * (width - len(seq))]), len(seq))))
        out += [seq[len(prompt):]] * G
    return out


def stopped(rows, stop: int) -> list[list[int]]:
    """Greedy rows that stop at their first `stop`: PAD (0) after it."""
    return [row[: row.index(stop) + 1] + [0] * (len(row) - row.index(stop) - 1) if stop in row else row
            for row in rows]


@pytest.fixture(scope="module")
def trained_params():
    """Parameters with LoRA adapters whose B is not zero (the folded weights differ from the base)."""
    plan = plan_of("data=1", lora_rank=4, lora_alpha=8)
    make, trainable = jaxpar.lora.for_plan(make_model, plan)
    model, state = init_state(make, optax.sgd(0.1), plan, trainable)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 * jax.random.normal(jax.random.key(len(str(path))), x.shape)
        if str(path[-1]).endswith("_lora_b']") else x, jax.device_get(state.params))
    return make, trainable, params, reference(params)


@pytest.mark.parametrize("mesh", ["data=8", "data=4,tensor=2"])
def test_greedy_on_a_plan_equals_one_device(mesh, trained_params):
    make, trainable, params, plain = trained_params
    stop = plain[0][2]  # the first prompt stops at its third token
    assert stop not in plain[0][:2]
    expected = stopped(plain, stop)
    plan = plan_of(mesh, lora_rank=4, lora_alpha=8)
    model, state = init_state(make, optax.sgd(0.1), plan, trainable)
    placed = jax.device_put(params, jax.tree.map(lambda a: a.sharding, state.params))  # as training shards them
    samples = jaxpar.sample(model, plan, PROMPTS, placed, group_size=G, max_new_tokens=NEW, temperature=0.0,
                            stop_tokens=[stop])
    assert samples.completion_ids.tolist() == expected
    assert samples.lengths[0] == 3 and not samples.truncated[0]
    assert samples.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert samples.prompt_ids == [p for p in PROMPTS for _ in range(G)]


def test_refusals():
    plan = plan_of("data=2,pipe=2")
    with pytest.raises(ValueError, match="pipe=1 and context=1"):
        jaxpar.sample(None, plan, PROMPTS)

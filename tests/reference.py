"""An independent single-device reference: the Llama (and its Qwen2/Qwen3/Gemma options) and MoE math in plain JAX + optax.

It reads the same parameter tree jaxpar's train state holds (`embedding`,
`blocks`, `final_norm`, `head`; the MoE model's `blocks` split into `prefix`, `dense` and
`moe`) and re-derives everything else: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, the masked padded-vocabulary loss, top-k routing with
capacity and dropping and the routers' auxiliary losses, the precision policies
(fp32 master copy, fp16 loss scaling) and the optimizer step. It imports
nothing from jaxpar or the models, so a bug in jaxpar's shared path (step, zero,
tensor, pipeline, experts, precision) cannot hide in it. Layers run in a Python
loop on whole arrays; microbatches are not split (accumulation only reorders sums).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtype the model computes in, whether an fp32 master copy is kept, and dynamic loss scaling."""

    dtype: Any
    master: bool
    loss_scaling: bool
    initial_scale: float = 2.0**15
    growth_interval: int = 2000


PRECISIONS = {
    "fp32": Precision(jnp.float32, master=False, loss_scaling=False),
    "bf16": Precision(jnp.bfloat16, master=True, loss_scaling=False),
    "fp16": Precision(jnp.float16, master=True, loss_scaling=True),
    "bf16-params": Precision(jnp.bfloat16, master=False, loss_scaling=False),
}


# -- the dense model ------------------------------------------------------------------


def norm(x, w, eps):
    """RMSNorm computed in fp32, returned in x's dtype."""
    h = x.astype(jnp.float32)
    h = h / jnp.sqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + eps)
    return (h * w.astype(jnp.float32)).astype(x.dtype)


def yarn(cfg, hd):
    """YaRN (Peng et al. 2023) as gpt-oss configures it: (inverse frequencies [hd / 2], the cos/sin multiplier).

    Dimension pair i turns r_i = L / wavelength_i times over the original context L; pairs turning more than
    beta_fast times keep theta's frequency, fewer than beta_slow take it / factor, and between the two the blend
    moves linearly in i between the pairs where r = beta_fast and r = beta_slow (rounded outwards when truncating)."""
    half = hd // 2
    base = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float32) / half))
    # pair index where a pair turns r times: L * base_i / (2 pi) = r  <=>  i = half * log(L / (2 pi r)) / log(theta)
    index = [half * np.log(cfg.rope_original_max_position / (2 * np.pi * r)) / np.log(cfg.rope_theta)
             for r in (cfg.rope_beta_fast, cfg.rope_beta_slow)]
    lo, hi = (np.floor(index[0]), np.ceil(index[1])) if cfg.rope_truncate else index
    lo, hi = max(lo, 0), min(hi, hd - 1)
    interpolated = np.clip((np.arange(half) - lo) / max(hi - lo, 1e-3), 0, 1).astype(np.float32)
    inv = base / np.float32(cfg.rope_factor) * interpolated + base * (1 - interpolated)
    scale = cfg.rope_attention_factor or (0.1 * np.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0)
    return inv.astype(np.float32), np.float32(scale)


def rope(x, theta, positions=None, factor=1.0, yarn_cfg=None):
    """Rotary embedding of [b, s, heads, hd] at `positions` ([s] or [b, s]; default 0, 1, ...): halves of hd rotate
    as pairs (fp32); frequencies divided by `factor` (linear scaling), or YaRN's of `yarn_cfg`."""
    s, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    inv = 1.0 / (theta ** (np.arange(half, dtype=np.float32) / half)) / np.float32(factor)
    scale = np.float32(1.0)
    if yarn_cfg is not None:
        inv, scale = yarn(yarn_cfg, hd)
    positions = jnp.arange(s) if positions is None else jnp.asarray(positions)
    ang = positions.reshape(-1, s).astype(jnp.float32)[..., None] * inv
    cos, sin = scale * jnp.cos(ang)[:, :, None, :], scale * jnp.sin(ang)[:, :, None, :]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def self_attention(p, x, cfg, window=None, positions=None):
    """Causal attention; query head h reads key/value head h // (n_heads / n_kv_heads).

    Gemma 2's options: scores times `query_scale` (for 1 / sqrt(head_dim)), soft-capped to
    attn_softcap * tanh(scores / attn_softcap); with a `window` query i sees keys i - window < j <= i.
    `positions` ([s] or [b, s]) rotate q and k (default 0, 1, ...).
    """
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
    if getattr(cfg, "qkv_bias", False):  # Qwen2: a bias per output feature of q, k and v
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if getattr(cfg, "qk_norm", False):  # Qwen3, Gemma 3 ((1 + w)): RMSNorm over each q and k head, before rotation
        q, k = residual_norm(q, p["q_norm"], cfg), residual_norm(k, p["k_norm"], cfg)
    # Gemma 3: local layers rotate with their own base, unscaled; global ones (and all others) by rope_theta, scaled
    local = window is not None and getattr(cfg, "rope_local_theta", None) is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    factor = cfg.rope_factor if not local and getattr(cfg, "rope_type", "default") == "linear" else 1.0
    yarn_cfg = cfg if getattr(cfg, "rope_type", "default") == "yarn" else None
    q, k = rope(q, theta, positions, factor, yarn_cfg), rope(k, theta, positions, factor, yarn_cfg)
    repeat = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    s = x.shape[1]
    logits = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)
    scale, cap = getattr(cfg, "query_scale", None), getattr(cfg, "attn_softcap", None)
    logits = logits / np.float32(np.sqrt(q.shape[-1])) if scale is None else logits * np.float32(scale)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    seen = np.tril(np.ones((s, s), bool))
    if window is not None:
        seen &= np.subtract.outer(np.arange(s), np.arange(s)) < window
    logits = jnp.where(seen, logits, jnp.finfo(jnp.float32).min)
    if getattr(cfg, "attn_sinks", False):  # gpt-oss: one more logit per head in the softmax, weighing no value
        sinks = jnp.broadcast_to(p["sinks"].astype(jnp.float32)[None, :, None, None], logits.shape[:3] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", probs, v), p["wo"])
    return out + p["bo"] if getattr(cfg, "attn_out_bias", False) else out


def masked_attention(q, k, v, segments=None, window=None, softcap=None, scale=None, sinks=None):
    """Plain masked softmax attention: q [b, s, heads, d], k and v [b, s, kv_heads, *] (K/V heads repeated),
    query i sees key j iff j <= i and i - j < window, in the same document (segment ids [b, s]); scores * scale,
    then c * tanh(scores / c), then the mask. A query that sees no key (padding, segment 0) gives 0.
    `sinks` [heads]: a logit per head appended to every row's softmax and dropped after it (gpt-oss)."""
    s, d = q.shape[1], q.shape[-1]
    repeat = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    seen = jnp.asarray((j <= i) & ((i - j < window) if window is not None else True))[None, None]
    if segments is not None:
        seen = seen & (segments[:, None, :, None] == segments[:, None, None, :]) & (segments[:, None, :, None] != 0)
    logits = jnp.where(seen, logits, -jnp.inf)
    if sinks is None:
        weights = jax.nn.softmax(logits, axis=-1)
    else:
        column = jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))
        weights = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
    weights = jnp.where(seen, weights, 0.0)  # rows that see nothing: softmax of all -inf is NaN
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def gelu_tanh(x):
    """GELU's tanh approximation, written out (Gemma's gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + jnp.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + 0.044715 * x**3)))


def gated_mlp(p, x, cfg):
    """SwiGLU, or GeGLU under mlp_activation='gelu_tanh' (Gemma)."""
    if getattr(cfg, "mlp_activation", "silu") == "gelu_tanh":
        return (gelu_tanh(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]
    return swiglu(x, p["w_gate"], p["w_up"], p["w_down"])


def residual_norm(x, w, cfg):
    """The blocks' and the final RMSNorm: weight w, or (1 + w) under norm_plus_one (Gemma)."""
    return norm(x, w + 1.0 if getattr(cfg, "norm_plus_one", False) else w, cfg.norm_eps)


def dense_block(p, x, cfg, window=None, positions=None):
    """Pre-norm block; under post_norms (Gemma 2) each sublayer's output is normed again before its residual add."""
    post = getattr(cfg, "post_norms", False)
    out = self_attention(p, residual_norm(x, p["attn_norm"], cfg), cfg, window, positions)
    x = x + (residual_norm(out, p["post_attn_norm"], cfg) if post else out)
    out = gated_mlp(p, residual_norm(x, p["mlp_norm"], cfg), cfg)
    return x + (residual_norm(out, p["post_mlp_norm"], cfg) if post else out)


def layer(stacked, i):
    return {k: v[i] for k, v in stacked.items()}


def embed(params, tokens, cfg=None):
    """The embedding rows of `tokens`, scaled by sqrt(d_model) under embed_scale (Gemma)."""
    x = params["embedding"][tokens]
    if getattr(cfg, "embed_scale", False):
        x = x * jnp.asarray(np.sqrt(cfg.d_model), x.dtype)
    return x


def cross_entropy(params, x, targets, cfg):
    """Mean next-token loss."""
    return jnp.mean(token_losses(params, x, targets, cfg))


def token_losses(params, x, targets, cfg):
    """Per-token next-token loss [b, s]; logits of the padded vocabulary columns (>= cfg.vocab) are excluded."""
    w = params["embedding"].T if cfg.tie_embeddings else params["head"]
    logits = (residual_norm(x, params["final_norm"], cfg) @ w).astype(jnp.float32)
    cap = getattr(cfg, "final_softcap", None)
    if cap is not None:  # Gemma 2: logits soft-capped to (-cap, cap)
        logits = cap * jnp.tanh(logits / cap)
    logits = logits[..., : cfg.vocab]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.scipy.special.logsumexp(logits, axis=-1) - picked


def llama_loss(params, batch, cfg):
    """(loss, metrics) of the dense Llama on a whole batch; Gemma's embeddings are scaled by sqrt(d_model)."""
    x = embed(params, batch["inputs"], cfg)
    for i in range(cfg.n_layers):
        x = dense_block(layer(params["blocks"], i), x, cfg, sliding_window(cfg, i))
    return cross_entropy(params, x, batch["targets"], cfg), {}


def sliding_window(cfg, i):
    """Layer i's window: none, or sliding_window except on every sliding_pattern-th layer (Gemma 2: odd ones)."""
    window, pattern = getattr(cfg, "sliding_window", None), getattr(cfg, "sliding_pattern", 1)
    return None if window is None or (pattern > 1 and (i + 1) % pattern == 0) else window


def documents_alone(batch) -> dict[str, np.ndarray]:
    """Every document (segment) of packed rows as a sequence of its own: [documents, seq] each, at the start of
    its row and padded after it (causal attention never looks ahead, so the padding changes nothing; weight 0)."""
    out = {k: [] for k in ("inputs", "targets", "positions", "loss_weights")}
    seq = batch["inputs"].shape[1]
    for r, ids in enumerate(np.asarray(batch["segment_ids"])):
        for segment in np.unique(ids[ids > 0]):
            at = np.flatnonzero(ids == segment)
            for name in out:
                row = np.zeros(seq, np.asarray(batch[name]).dtype)
                row[: at.size] = np.asarray(batch[name])[r, at]
                out[name].append(row)
    return {name: np.stack(rows) for name, rows in out.items()}


def document_loss(params, alone, cfg):
    """(sum(w * nll) / sum(w), {}) of documents each run on its own (`documents_alone`) at its own positions."""
    x = embed(params, jnp.asarray(alone["inputs"]), cfg)
    for i in range(cfg.n_layers):
        x = dense_block(layer(params["blocks"], i), x, cfg, sliding_window(cfg, i), alone["positions"])
    nll = token_losses(params, x, jnp.asarray(alone["targets"]), cfg)
    weights = jnp.asarray(alone["loss_weights"])
    return jnp.sum(weights * nll) / jnp.sum(weights), {}


# -- the MoE model ----------------------------------------------------------------------


def experts_ffn(p, x, cfg):
    """Top-k experts per token in routing groups of a sequence (or cfg.group_size tokens).

    Assignment priority is all first choices in token order, then all second
    choices, ...; an expert keeps at most `capacity` of a group's assignments and
    a dropped one contributes nothing. Returns (y, load-balance term, z term),
    the terms averaged over groups and not yet weighted by their coefficients.
    """
    b, s, d = x.shape
    group = cfg.group_size or s
    e, k = cfg.n_experts, cfg.top_k
    if cfg.dropless:
        capacity = group
    else:
        capacity = max(1, min(group, int(np.ceil(k * group * cfg.capacity_factor / e - 1e-9))))
    tokens = x.reshape(-1, group, d)
    logits = tokens.astype(jnp.float32) @ p["router"].astype(jnp.float32)  # [g, t, e]
    if getattr(cfg, "expert_bias", False):
        logits = logits + p["router_bias"]
    probs = jax.nn.softmax(logits, axis=-1)
    top, choice = jax.lax.top_k(probs, k)  # [g, t, k]
    gates = top if k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    onehot = choice[..., None] == jnp.arange(e)  # [g, t, k, e]
    order = jnp.swapaxes(onehot, 1, 2).reshape(onehot.shape[0], k * group, e)  # choice-major
    before = jnp.cumsum(order, axis=1) - order  # assignments to the same expert ahead in priority
    kept = jnp.swapaxes((order & (before < capacity)).reshape(-1, k, group, e), 1, 2)  # [g, t, k, e]
    weight = jnp.sum(jnp.where(kept, gates[..., None], 0.0), axis=2)  # [g, t, e]
    y = jnp.zeros(tokens.shape, jnp.float32)
    for j in range(e):
        if getattr(cfg, "expert_bias", False):  # gpt-oss: biased projections around the clamped SwiGLU
            out = clamped_swiglu(tokens @ p["expert_gate"][j] + p["expert_gate_bias"][j],
                                 tokens @ p["expert_up"][j] + p["expert_up_bias"][j], cfg)
            out = out @ p["expert_down"][j] + p["expert_down_bias"][j]
        else:
            out = swiglu(tokens, p["expert_gate"][j], p["expert_up"][j], p["expert_down"][j])
        y = y + weight[..., j, None] * out.astype(jnp.float32)
    share = jnp.mean(onehot, axis=(1, 2))  # [g, e]: each expert's share of the group's assignments
    balance = jnp.mean(e * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1))
    z = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)
    return y.astype(x.dtype).reshape(b, s, d), balance, z


def clamped_swiglu(gate, up, cfg):
    """gpt-oss's gate: gate capped at +limit, up clipped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = jnp.minimum(gate, cfg.swiglu_limit), jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * gate / (1 + jnp.exp(-cfg.swiglu_alpha * gate))


def moe_loss(params, batch, cfg):
    """(loss, metrics) of the MoE Llama: `first_dense` dense blocks (`prefix`), then groups of `moe_every` blocks,
    `moe_pattern`'s kinds (D dense, M MoE; by default `moe_every - 1` dense, then one MoE), the dense ones read in
    order from `dense` and the MoE ones from `moe`."""
    blocks = params["blocks"]
    first = getattr(cfg, "first_dense", 0)
    group = getattr(cfg, "moe_pattern", "") or "D" * (cfg.moe_every - 1) + "M"
    x = embed(params, batch["inputs"], cfg)
    aux = jnp.zeros((), jnp.float32)
    for i in range(first):
        x = dense_block(layer(blocks["prefix"], i), x, cfg, sliding_window(cfg, i))
    dense, moe = 0, 0
    for i in range(first, cfg.n_layers):
        if group[(i - first) % len(group)] == "D":
            x = dense_block(layer(blocks["dense"], dense), x, cfg, sliding_window(cfg, i))
            dense += 1
            continue
        p = layer(blocks["moe"], moe)
        moe += 1
        x = x + self_attention(p, norm(x, p["attn_norm"], cfg.norm_eps), cfg, sliding_window(cfg, i))
        y, balance, z = experts_ffn(p, norm(x, p["mlp_norm"], cfg.norm_eps), cfg)
        x = x + y
        aux = aux + cfg.load_balance_coef * balance + (cfg.router_z_coef * z if cfg.router_z_coef else 0.0)
    ce = cross_entropy(params, x, batch["targets"], cfg)
    return ce + aux, {"ce_loss": ce}


def loss_fn(cfg) -> Callable:
    """The reference loss for a model config (MoE when it has experts); plain rotary frequencies only."""
    if getattr(cfg, "rope_type", "default") not in ("default", "linear", "yarn"):
        raise ValueError(f"the reference implements rope_type 'default', 'linear' and 'yarn' only, got "
                         f"{cfg.rope_type!r}")
    fn = moe_loss if hasattr(cfg, "n_experts") else llama_loss
    return lambda params, batch: fn(params, batch, cfg)


# -- training ---------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    losses: np.ndarray  # the loss of each step, before its update
    grad_norms: np.ndarray  # global norm of each step's (unscaled) gradients, before clipping
    params: Any  # final parameters (the compute copy, as the train state holds them)
    master: Any  # final fp32 master copy (None without one)


def train(loss, params0, batches, optimizer: optax.GradientTransformation, precision: str = "fp32") -> Result:
    """Train from fp32 `params0` on each batch in turn: value_and_grad, the precision policy, optax.

    Mirrors what a training step promises: a step whose loss or gradient norm is
    not finite leaves parameters and optimizer state unchanged; under fp16 the
    loss is scaled before differentiation, the gradients unscaled in fp32, and the
    scale halves (not below 1) on overflow and doubles after `growth_interval`
    finite steps.
    """
    pol = PRECISIONS[precision]
    to_compute = lambda tree: jax.tree.map(lambda a: jnp.asarray(a).astype(pol.dtype), tree)  # noqa: E731
    params = to_compute(params0)
    master = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params0) if pol.master else None
    opt_state = optimizer.init(master if pol.master else params)
    scale = jnp.float32(pol.initial_scale if pol.loss_scaling else 1.0)
    good = jnp.int32(0)

    @jax.jit
    def step(params, master, opt_state, scale, good, batch):
        def objective(p):
            value, _ = loss(p, batch)
            return (value * scale if pol.loss_scaling else value), value

        grads, value = jax.grad(objective, has_aux=True)(params)
        if not pol.master:
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params, new_master = optax.apply_updates(params, updates), None
        else:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            if pol.loss_scaling:
                grads = jax.tree.map(lambda g: g / scale, grads)
            updates, new_opt = optimizer.update(grads, opt_state, master)
            new_master = optax.apply_updates(master, updates)
            new_params = jax.tree.map(lambda m: m.astype(pol.dtype), new_master)
        norm_ = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        if pol.loss_scaling:
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            grown = jnp.where(finite, good + 1, 0)
            new_scale = jnp.where(finite, jnp.where(grown >= pol.growth_interval, scale * 2, scale),
                                  jnp.maximum(scale / 2, 1.0))
            new_good = jnp.where(grown >= pol.growth_interval, 0, grown).astype(jnp.int32)
            new_params = jax.tree.map(lambda m: m.astype(pol.dtype), _pick(finite, new_master, master))
            new_master, new_opt = _pick(finite, (new_master, new_opt), (master, opt_state))
            return value, norm_, new_params, new_master, new_opt, new_scale, new_good
        finite = jnp.isfinite(value) & jnp.isfinite(norm_)
        new_params, new_master, new_opt = _pick(finite, (new_params, new_master, new_opt), (params, master, opt_state))
        return value, norm_, new_params, new_master, new_opt, scale, good

    losses, norms = [], []
    for batch in batches:
        value, norm_, params, master, opt_state, scale, good = step(params, master, opt_state, scale, good, batch)
        losses.append(float(value))
        norms.append(float(norm_))
    return Result(np.array(losses), np.array(norms), jax.device_get(params), jax.device_get(master))


def _pick(cond, new, old):
    return jax.tree.map(lambda n, o: jnp.where(cond, n, o), new, old)

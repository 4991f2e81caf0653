"""LoRA: low-rank adapters beside a model's weights, W + (alpha / r) A B, trained while W stays frozen.

The model never changes. `apply` puts three variables beside each targeted
weight `w` of an NNX module: `w_lora_a` [..., d_in, r] (random) and `w_lora_b`
[..., r, d_out] (zero), both `nnx.LoRAParam` as in Flax's own `nnx.LoRA`, and
`w_lora_scale` (alpha / r, a frozen `nnx.Param` with the weight's stacked
`layers`/`experts` dimensions, so that it travels wherever the weight's layers
go: pipeline stages, regrouped layer patterns), and with dropout `w_lora_salt`
(int32, per layer, frozen: what its dropout mask is drawn with,
`jaxpar.parallel.lora_dropout`). A takes the weight's logical
names on its input dimensions and B on its output ones, the rank dimension
replicated, so every plan shards them like the weight itself.

The effective weight is formed where the weight is fetched for use (`fold`):
per layer inside `jaxpar.scan_layers`, after that layer's ZeRO gather, so one
layer's delta exists at a time; for weights outside a layer stack, once in the
step (`jaxpar.train.step`). `apply` returns the filter of what trains,
`nnx.LoRAParam`: `init_state(..., trainable=...)` gives the frozen base no
gradient, no optimizer state and no gradient sum.
"""

from __future__ import annotations

import fnmatch
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.core import zero_layout
from jaxpar.parallel import constrain, lora_dropout, quantized_base

A, B, SCALE, SALT = "_lora_a", "_lora_b", "_lora_scale", "_lora_salt"
TRAINABLE = nnx.LoRAParam  # the filter `apply` returns: only the adapters train
STACKED = (zero_layout.SCANNED, zero_layout.PREFIX_SCANNED, "experts")  # leading dimensions a weight is a stack of (layers, experts)
HEADS = ("heads", "kv_heads")  # a heads dimension and the head_dim after it are one input or output group

# `--lora-targets` short names -> the weights they name in jaxpar's models (dense MLP and each expert's)
SHORT_NAMES = {"q": ("wq",), "k": ("wk",), "v": ("wv",), "o": ("wo",), "gate": ("w_gate", "expert_gate"),
               "up": ("w_up", "expert_up"), "down": ("w_down", "expert_down")}


def patterns_of(targets) -> tuple[str, ...]:
    """Path patterns from short names (q, k, v, o, gate, up, down) or patterns given as they are."""
    out = []
    for t in targets:
        out += [f"*{name}" for name in SHORT_NAMES[t]] if t in SHORT_NAMES else [t]
    return tuple(out)


def _split_dims(names: tuple, path: str) -> tuple[int, int, int]:
    """(stacked, input, output) dimension counts of a weight from its logical names."""
    lead = 0
    while lead < len(names) and names[lead] in STACKED:
        lead += 1
    rest = names[lead:]
    n_in = 2 if rest and rest[0] in HEADS else 1
    if len(rest) - n_in < 1 or (len(rest) - n_in > 1 and rest[n_in] not in HEADS):
        raise ValueError(f"LoRA target {path} has logical names {names}: an adapter needs [stacked..., input, "
                         f"output] (a heads dimension with head_dim counting as one)")
    return lead, n_in, len(rest) - n_in


def _weights(model: nnx.Module):
    """(path 'a/b/w', module, attribute) of every nnx.Param of `model` that is not itself an adapter."""
    for path, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if type(value) is nnx.Param and not name.endswith((SCALE, SALT)):
                yield "/".join(str(p) for p in (*path, name)), module, name


def apply(model: nnx.Module, rank: int, alpha: float | None = None, targets=("q", "k", "v", "o"),
          rngs: nnx.Rngs | None = None, dropout: float = 0.0):
    """Put LoRA adapters of `rank` on the weights of `model` whose paths match `targets`; return the trainable filter.

    `targets`: short names (q, k, v, o, gate, up, down) or fnmatch patterns on
    paths such as 'blocks/wq' or '*/kernel'. `alpha` defaults to `rank` (scale
    1). A starts He-uniform from `rngs` (default nnx.Rngs(0)), B at zero, so the
    model starts equal to its base. Call it inside the function that builds the
    model (the one `init_state` gets), then pass the returned filter as
    `init_state(..., trainable=...)`. A target naming no weight, or a rank larger
    than a weight's input or output size, is refused here. `dropout` > 0 (the
    plan's lora_dropout) gives each adapter the salt its dropout mask is drawn
    with; it acts in jaxpar's built-in models' layer stacks, not on an expert's
    weights nor outside a stack (refused).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    weights = list(_weights(model))
    chosen = []
    for target in targets:
        hits = [w for w in weights if any(fnmatch.fnmatchcase(w[0], p) for p in patterns_of((target,)))]
        if not hits:
            raise ValueError(f"--lora-targets {target!r} names no weight of the model; its weights: "
                             f"{', '.join(w[0] for w in weights)}")
        chosen += [w for w in hits if w not in chosen]
    for path, module, name in chosen:
        _attach(module, name, path, rank, alpha, rngs, dropout)
    return TRAINABLE


def _attach(module: nnx.Module, name: str, path: str, rank: int, alpha: float, rngs: nnx.Rngs,
            dropout: float) -> None:
    base = getattr(module, name)
    value = base.get_value()
    names = tuple(base.get_metadata().get("out_sharding") or (None,) * value.ndim)
    lead, n_in, n_out = _split_dims(names, path)
    d_in, d_out = value.shape[lead:lead + n_in], value.shape[lead + n_in:]
    for what, dims in (("input", d_in), ("output", d_out)):
        size = math.prod(dims)
        if rank > size:
            raise ValueError(f"--lora-rank {rank} is larger than {path}'s {what} dimension ({size})")
    stack, lead_names = value.shape[:lead], names[:lead]
    init_a = nnx.initializers.he_uniform(in_axis=tuple(range(lead, lead + n_in)), out_axis=-1,
                                         batch_axis=tuple(range(lead)))
    a_names, b_names = (*lead_names, *names[lead:lead + n_in], None), (*lead_names, None, *names[lead + n_in:])
    setattr(module, name + A, nnx.LoRAParam(nnx.with_partitioning(init_a, a_names)(
        rngs.params(), (*stack, *d_in, rank), value.dtype)))
    setattr(module, name + B, nnx.LoRAParam(nnx.with_partitioning(nnx.initializers.zeros, b_names)(
        rngs.params(), (*stack, rank, *d_out), value.dtype)))
    scale = lambda key, shape, dtype: jnp.full(shape, alpha / rank, dtype)  # noqa: E731
    setattr(module, name + SCALE, nnx.Param(nnx.with_partitioning(scale, lead_names)(
        rngs.params(), stack, jnp.float32)))
    if dropout:
        if lead_names not in ((zero_layout.SCANNED,), (zero_layout.PREFIX_SCANNED,)):
            raise ValueError(f"--lora-dropout {dropout} acts on the weights of a layer stack, not on {path} (logical "
                             f"names {names}): leave it out of --lora-targets or use --lora-dropout 0")
        salt = lambda key, shape, dtype: jnp.asarray(lora_dropout.salts(path, shape))  # noqa: E731
        setattr(module, name + SALT, nnx.Param(nnx.with_partitioning(salt, lead_names)(
            None, stack, jnp.int32)))  # no key drawn: the adapters are those of lora_dropout 0


def trainable_for(plan):
    """The filter of what trains under `plan`: the adapters with lora_rank, else every nnx.Param."""
    return TRAINABLE if plan.lora_rank else nnx.Param


def for_plan(make_model, plan):
    """(`make_model` with the plan's adapters put on, its base quantized under base_dtype, the trainable filter);
    as given, nnx.Param, without lora_rank."""
    if not plan.lora_rank:
        return make_model, nnx.Param

    def adapted():
        model = make_model()
        apply(model, plan.lora_rank, plan.lora_alpha or None, plan.lora_targets, dropout=plan.lora_dropout)
        if plan.base_dtype != "none":
            quantized_base.store(model, plan.base_dtype)
        return model

    return adapted, TRAINABLE


def delta(a, b, scale):
    """(alpha / r) A B in the weight's shape: A [lead..., in..., r], B [lead..., r, out...], scale [lead...].

    Its backward keeps A and B, never the product, and never forms it again: a
    remat policy that keeps matmul outputs (`jaxpar.parallel.stack.remat_wrapper`)
    would otherwise keep a weight-sized A B for every layer. The scale is a
    constant (alpha / r): no gradient reaches it.
    """
    return _low_rank(a, b, jax.lax.stop_gradient(scale))


@jax.custom_vjp
def _low_rank(a, b, scale):
    lead, rank = scale.ndim, a.shape[-1]
    d_in, d_out = a.shape[lead:-1], b.shape[lead + 1:]
    ab = jnp.matmul(a.reshape(*a.shape[:lead], math.prod(d_in), rank),
                    b.reshape(*b.shape[:lead], rank, math.prod(d_out)))
    ab = ab * scale.reshape(*scale.shape, 1, 1).astype(ab.dtype)
    return ab.reshape(*a.shape[:lead], *d_in, *d_out)


def _low_rank_forward(a, b, scale):
    return _low_rank(a, b, scale), (a, b, scale)


def _low_rank_backward(saved, cotangent):
    """dA = s g B^T and dB = s A^T g, from the cotangent g of the product: A B is not formed again."""
    a, b, scale = saved
    lead, rank = scale.ndim, a.shape[-1]
    a2, b2 = a.reshape(*a.shape[:lead], -1, rank), b.reshape(*b.shape[:lead], rank, -1)
    g = cotangent.reshape(*a2.shape[:-1], b2.shape[-1]).astype(a.dtype)
    s = scale.reshape(*scale.shape, 1, 1).astype(a.dtype)
    d_a = jnp.matmul(g, jnp.swapaxes(b2, -1, -2)) * s
    d_b = jnp.matmul(jnp.swapaxes(a2, -1, -2), g) * s
    return _summed_like(d_a.reshape(a.shape), a), _summed_like(d_b.reshape(b.shape), b), jnp.zeros_like(scale)


def _summed_like(cotangent, primal):
    """`cotangent` summed over the manual axes it varies over and `primal` does not (inside a shard_map: an A
    whole over tensor beside a B split over it), as autodiff sums where it broadcast the primal."""
    extra = tuple(sorted(constrain.varying_axes(cotangent) - constrain.varying_axes(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


_low_rank.defvjp(_low_rank_forward, _low_rank_backward)


def _adapter_of(key, tree) -> str | None:
    """The weight an adapter key (w_lora_a, w_lora_b, w_lora_scale, w_lora_salt) belongs to, None for any other."""
    for suffix in (A, B, SCALE, SALT):
        if isinstance(key, str) and key.endswith(suffix) and key[:-len(suffix)] + SCALE in tree:
            return key[:-len(suffix)]
    return None


def has_salts(tree) -> bool:
    """Whether a parameter tree (nested dicts) holds adapters' dropout salts (`apply(..., dropout=p)`)."""
    return isinstance(tree, dict) and any(isinstance(k, str) and k.endswith(SALT) or has_salts(v)
                                          for k, v in tree.items())


def adapted_names(paths) -> list[str]:
    """The weights ('blocks/wq') that carry adapters among saved parameter paths ('blocks/wq_lora_scale', ...)."""
    return sorted(path.removesuffix(SCALE) for path in paths if path.endswith(SCALE))


def fold(tree, unstacked_only: bool = False, keep: bool = False):
    """`tree` (nested dicts of arrays) with each adapted weight W replaced by W + (alpha / r) A B.

    `unstacked_only`: only the weights outside a layer stack (a scalar scale),
    leaving stacked ones for the layer scan to fold one layer at a time.
    `keep`: the adapters stay in the tree (to merge a module from it); else they
    are dropped, so that a nested layer scan cannot fold them twice. A weight
    held quantized (QLoRA, `jaxpar.parallel.quantized_base`: only stacked ones)
    is dequantized first. In a training step with lora_dropout, a weight with a
    salt is not folded but left `lora_dropout.Adapted`: its branch runs apart.
    """
    if not isinstance(tree, dict):
        return tree
    if not unstacked_only:
        tree = quantized_base.dequantized(tree, keep)
    out = {}
    for key, value in tree.items():
        base = _adapter_of(key, tree)
        chosen = lambda w: not unstacked_only or tree[w + SCALE].ndim == 0  # noqa: E731
        if base is not None:
            if keep or not chosen(base):
                out[key] = value
        elif isinstance(key, str) and key + SCALE in tree and chosen(key):
            if not keep and key + SALT in tree and lora_dropout.rate():
                out[key] = lora_dropout.Adapted(value, *(tree[key + s] for s in (A, B, SCALE, SALT)))
            else:
                out[key] = value + delta(tree[key + A], tree[key + B], tree[key + SCALE]).astype(value.dtype)
        else:
            out[key] = fold(value, unstacked_only, keep)
    return out


def with_saved_adapters(saved, target, sharding):
    """`target` (the plain model's parameter shapes) plus, beside each weight, the adapters `saved` (a checkpoint's
    parameter tree) holds for it, placed by `sharding`: what to read to fold a LoRA checkpoint into its weights."""
    if not isinstance(saved, dict) or not isinstance(target, dict):
        return target
    out = {key: with_saved_adapters(saved.get(key), value, sharding) for key, value in target.items()}
    for key, value in saved.items():
        base = _adapter_of(key, saved)
        if base is not None and base in target:
            out[key] = jax.ShapeDtypeStruct(tuple(value.shape), value.dtype, sharding=sharding)
    return out


def refill(folded, like):
    """`folded` (one layer, adapters dropped) with zeros in place of the adapters `like` (all layers) holds.

    For a module merged from the folded layer (`jaxpar.Stack`): its adapters are
    variables it has but never reads, since the folded weight carries them.
    """
    if not isinstance(like, dict):
        return folded
    return {k: refill(folded[k], v) if k in folded else jnp.zeros(v.shape[1:], v.dtype) for k, v in like.items()}


def merged(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with every adapter folded into its weight, for inference and export (the logits, decode).

    The adapters stay with a zero scale: the copy's weights already carry them, and the inference forward, which
    folds each layer's adapters itself (`jaxpar.models.inference`), adds nothing to them.
    """
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, _scales_zeroed(fold(nnx.to_pure_dict(state), keep=True)))
    return nnx.merge(graphdef, state)


def _scales_zeroed(tree):
    """`tree` with every adapter's scale (alpha / r) set to 0: its adapters fold to nothing."""
    if not isinstance(tree, dict):
        return tree
    return {k: jnp.zeros_like(v) if isinstance(k, str) and k.endswith(SCALE) else _scales_zeroed(v)
            for k, v in tree.items()}


def without_adapters(tree):
    """A parameter tree whose adapters fold to nothing (scales 0): the frozen base, the reference policy of
    preference and reinforcement learning under LoRA, with no second copy of any weight."""
    return _scales_zeroed(tree)

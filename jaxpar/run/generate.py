"""Text generation: greedy decoding and temperature / top-p sampling with a KV cache, laid out by a plan.

Prompts are left-padded to one length with a padding mask, so every sequence
writes the same cache slot at each step while keeping its own positions. The
whole generation (prefill, then one `lax.scan` over new tokens) is one jitted
function under the plan: parameters on the plan's shardings, the batch and the
cache split over the batch axes (`data`) and the cache's kv heads over `tensor`.
Without the cache the same tokens come from re-running the full sequence at
every step, which the tests use as the reference.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def sample(logits, key, temperature: float, top_p: float):
    """Next tokens [batch] from logits [batch, vocab]: argmax at temperature 0, else softmax(logits / T) within top-p."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # keep the smallest prefix whose probability reaches top_p: a token stays if the mass before it is < top_p
        kept = jnp.sum((cumulative - jax.nn.softmax(ordered, axis=-1)) < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], rows: int | None = None, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) [rows, longest]: prompts right-aligned; extra rows (to fill a batch) repeat the last prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    rows = len(prompts) if rows is None else rows
    longest = max(len(p) for p in prompts)
    tokens = np.full((rows, longest), pad, np.int32)
    mask = np.zeros((rows, longest), bool)
    for i in range(rows):
        p = prompts[min(i, len(prompts) - 1)]
        tokens[i, longest - len(p):] = p
        mask[i, longest - len(p):] = True
    return tokens, mask


def end_ids(eos: int | Sequence[int] | None) -> list[int]:
    """The ids that end a sequence: `eos` as an int or several (a config's `eos_token_id` may be a list)."""
    return [] if eos is None else [int(eos)] if isinstance(eos, (int, np.integer)) else [int(e) for e in eos]


def make_generate(model_def, cfg, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                  eos: int | Sequence[int] | None = None, use_cache: bool = True):
    """A jittable (params, tokens, mask, key) -> new tokens [batch, max_new_tokens].

    After a sequence emits one of the `eos` ids it emits the first of them until the end.
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    ends = end_ids(eos)

    def choose(logits, key, done):
        token = sample(logits, key, temperature, top_p)
        if not ends:
            return token, done
        token = jnp.where(done, ends[0], token)
        return token, done | jnp.isin(token, jnp.asarray(ends, jnp.int32))

    def with_cache(params, tokens, mask, key):
        model = model_def.merge(params)
        batch, length = tokens.shape
        cache = model.init_cache(batch, length + max_new_tokens, jnp.dtype(cfg.param_dtype))
        logits, cache = model.decode(tokens, cache, mask)

        def step(carry, key):
            cache, last, done = carry
            token, done = choose(last, key, done)
            logits, cache = model.decode(token[:, None], cache)
            return (cache, logits[:, -1], done), token

        done = jnp.zeros((batch,), bool)
        _, new = jax.lax.scan(step, (cache, logits[:, -1], done), jax.random.split(key, max_new_tokens))
        return new.T

    def without_cache(params, tokens, mask, key):
        model = model_def.merge(params)
        batch, length = tokens.shape
        seq = jnp.concatenate([tokens, jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1)
        seq_mask = jnp.concatenate([mask, jnp.zeros((batch, max_new_tokens), bool)], axis=1)

        def step(carry, inputs):
            seq, seq_mask, done = carry
            i, key = inputs
            logits = model.logits(seq, mask=seq_mask)
            last = jax.lax.dynamic_index_in_dim(logits, length + i - 1, axis=1, keepdims=False)
            token, done = choose(last, key, done)
            seq = jax.lax.dynamic_update_slice(seq, token[:, None], (0, length + i))
            seq_mask = jax.lax.dynamic_update_slice(seq_mask, jnp.ones((batch, 1), bool), (0, length + i))
            return (seq, seq_mask, done), token

        done = jnp.zeros((batch,), bool)
        steps = (jnp.arange(max_new_tokens), jax.random.split(key, max_new_tokens))
        _, new = jax.lax.scan(step, (seq, seq_mask, done), steps)
        return new.T

    return with_cache if use_cache else without_cache


class Generator:
    """Generation of one model under one plan, compiled once per (batch, prompt length)."""

    def __init__(self, model_def, cfg, params, plan, **options):
        if plan.shape["pipe"] > 1:
            raise ValueError(f"generation runs the layers in one scan: use a mesh with pipe=1, got pipe={plan.shape['pipe']}")
        self.model_def, self.cfg, self.plan = model_def, cfg, plan
        self.params = jax.device_put(params, plan.shardings(plan.param_specs(model_def.logical)))
        self.options = options
        self._fn = jax.jit(make_generate(model_def, cfg, **options))
        self._batch_sharding = plan.sharding(plan.batch_spec(2))

    @property
    def batch_ways(self) -> int:
        return self.plan.axis_size(*self.plan.batch_axes)

    def __call__(self, prompts: Sequence[Sequence[int]], seed: int = 0) -> tuple[list[list[int]], dict]:
        """New tokens per prompt, and timings: compile, generate (s) and tokens/s of the generation alone."""
        ways = self.batch_ways
        rows = -(-len(prompts) // ways) * ways
        tokens, mask = left_pad(prompts, rows)
        for token in {int(t) for p in prompts for t in p}:
            if not 0 <= token < self.cfg.vocab:
                raise ValueError(f"prompt token {token} is outside the model's vocabulary of {self.cfg.vocab}")
        tokens, mask = (jax.device_put(a, self._batch_sharding) for a in (tokens, mask))
        key = jax.random.key(seed)
        with self.plan.activate():
            began = time.perf_counter()
            compiled = self._fn.lower(self.params, tokens, mask, key).compile()
            compiled_s = time.perf_counter() - began
            began = time.perf_counter()
            new = np.asarray(jax.device_get(compiled(self.params, tokens, mask, key)))
            seconds = time.perf_counter() - began
        count = new.shape[1] * len(prompts)
        stats = {"compile_s": compiled_s, "generate_s": seconds, "new_tokens": count, "tokens_per_s": count / seconds}
        return [row.tolist() for row in new[: len(prompts)]], stats


def generation_plan(mesh: str | None, devices=None):
    """The plan inference runs under: the mesh given (default one device) on the first devices it needs."""
    import math

    from jaxpar.core.mesh import parse_mesh
    from jaxpar.core.plan import Plan

    spec, options = parse_mesh(mesh or "data=1")
    wanted = math.prod(spec.shape.values())
    if devices is None and wanted > 0 and wanted <= jax.device_count():
        devices = jax.devices()[:wanted]
    return Plan.create(spec, devices=devices, **options)


def generate_from_checkpoint(path, prompts: Sequence[str], mesh: str | None = None, max_new_tokens: int = 32,
                             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos: int | None = None,
                             tokenizer: str | None = None, step: int | None = None, use_cache: bool = True,
                             chat: bool = False) -> dict:
    """`jaxpar generate`: texts continuing `prompts` from a training checkpoint, export or HF directory.

    Generation stops at `eos`, by default at the model config's `eos_token_id`(s), as transformers does.
    With `chat`, each prompt is a user message rendered by the tokenizer's chat template with the
    assistant's header after it, and generation stops at the template's end-of-turn token (unless `eos`
    names another): the reply a model instruction-tuned on that template gives.
    """
    from jaxpar.interop import hf, saved_weights
    from jaxpar.models import model_factory
    from jaxpar.train.state import describe

    name, cfg = hf.saved_model_config(path)
    if chat:
        prompt_ids, end_of_turn, decode = chat_codec(tokenizer, cfg.vocab, prompts)
        eos = end_of_turn if eos is None else eos
    else:
        encode, decode = text_codec(tokenizer, cfg.vocab)
        prompt_ids = [encode(p) for p in prompts]
        eos = config_eos(path) if eos is None else eos
    plan = generation_plan(mesh)
    model = describe(model_factory(name, cfg, 0))
    params = saved_weights.load_params(path, model, plan, step)
    generator = Generator(model, cfg, params, plan, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, eos=eos, use_cache=use_cache)
    new, stats = generator(prompt_ids, seed)
    ends = set(end_ids(eos))
    texts = [decode(row[: next((i for i, t in enumerate(row) if t in ends), len(row))]) for row in new]
    return {"prompts": list(prompts), "completions": texts, "tokens": new, "prompt_tokens": prompt_ids,
            "eos": eos, **stats}


def chat_codec(tokenizer: str | None, vocab: int, prompts: Sequence[str]):
    """(each prompt's ids as the chat template writes it for a reply, the end-of-turn id, decode).

    The rendered text holds the template's own BOS and headers, so it is encoded without what the
    tokenizer's post-processor would add again.
    """
    from jaxpar.data.records import ChatTemplate, encode_pieces
    from jaxpar.data.tokenize import check_covers, load_tokenizer

    template = ChatTemplate.of(tokenizer, "--chat renders each --prompt as a user message with the chat template")
    loaded = load_tokenizer(tokenizer)
    check_covers(loaded, vocab, "--tokenizer")
    rendered = [template.render([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    ids = [piece.tolist() for piece in encode_pieces(rendered, loaded)]
    return ids, template.end_of_turn(loaded), loaded.decode


def text_codec(tokenizer: str | None, vocab: int):
    """(encode, decode) between text and token ids: UTF-8 bytes by default, a tokenizer.json or a SentencePiece .model.

    Without a tokenizer an id that is no byte (a model of more than 256 ids) is shown as `<id>`, never dropped."""
    from jaxpar.data.tokenize import check_covers, load_tokenizer

    loaded = load_tokenizer(tokenizer)
    check_covers(loaded, vocab, "--tokenizer" if tokenizer else "byte tokens")
    return (lambda text: [int(i) for i in loaded.encode([text])[0]]), loaded.decode if tokenizer else bytes_and_ids


def bytes_and_ids(ids: Sequence[int]) -> str:
    """Byte ids as UTF-8 text (runs decoded together, so a character of several bytes survives), others as `<id>`."""
    out, run = [], bytearray()
    for i in ids:
        if 0 <= i < 256:
            run.append(i)
            continue
        out += [run.decode("utf-8", errors="replace"), f"<{i}>"]
        run = bytearray()
    return "".join([*out, run.decode("utf-8", errors="replace")])


def config_eos(path) -> int | list[int] | None:
    """The end-of-sequence id(s) of the model at `path`: a Hugging Face directory's generation_config.json, else the
    `eos_token_id` of the config.json its weights came from (a checkpoint's run config keeps it); None without one."""
    import json
    from pathlib import Path

    from jaxpar.interop import hf

    generation = Path(path) / "generation_config.json"
    if generation.is_file() and (eos := json.loads(generation.read_text()).get("eos_token_id")) is not None:
        return eos
    return (hf.saved_hf_config(path) or {}).get("eos_token_id")

"""Packed documents and fine-tuning records: the packer's rows, and a packed batch trains like each document alone.

The reference (tests/reference.py `document_loss`) runs every document of a
packed row as its own sequence at its own positions, and weights its tokens as
the packer says: sum(w * nll) / sum(w) over the global batch. jaxpar runs the
packed rows with their segment ids, positions and loss weights on each mesh.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference as reference_lib
from helpers import copy_state, max_relative_error, single_device_plan
from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.data import records
from jaxpar.data.tokenize import BYTES
from jaxpar.data.packed import packing_of
from jaxpar.models.llama import Llama, LlamaConfig
from jaxpar.pipeline.executor import bubble_fill
from jaxpar.pipeline.layer_order import to_natural_order, to_pipeline_order
from jaxpar.data import packing, sources
from jaxpar.data.packing import Document
from jaxpar.data.record_index import RecordIndex
from jaxpar.train.state import init_state
from jaxpar.train.step import loss_and_grads, make_train_step

CONFIG = LlamaConfig(vocab=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, seq_len=16)
ROWS = 8


# -- the packer ------------------------------------------------------------------------


def test_documents_pack_whole_in_order_with_their_own_ids_positions_and_weights():
    docs = [Document(np.array([1, 2, 3, 4])), Document(np.array([5, 6, 7])), Document(np.array([8, 9, 10, 11, 12]))]
    rows = packing.pack(docs, seq_len=7)  # rows of 8 tokens: docs 1 and 2 fit, doc 3 starts the next row
    np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 0, 0, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 0, 0, 0]])
    batch = packing.as_batch(rows)
    np.testing.assert_array_equal(batch["inputs"][0], [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(batch["targets"][0], [2, 3, 4, 5, 6, 7, 0])
    # 4 -> 5 crosses a document boundary, 7 -> padding predicts nothing: weight 0
    np.testing.assert_array_equal(batch["loss_weights"], [[1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch["segment_ids"][1], [1, 1, 1, 1, 1, 0, 0])


def test_a_long_document_is_split_into_row_sized_pieces_with_positions_continuing():
    doc = Document(np.arange(1, 14), mask=np.r_[np.zeros(3), np.ones(10)])  # 13 tokens, the first 3 a prompt
    rows = packing.pack([doc, Document(np.array([20, 21]))], seq_len=5)  # rows of 6
    # pieces overlap by one token, so each of the 12 next-token targets is trained once
    np.testing.assert_array_equal(rows["tokens"], [[1, 2, 3, 4, 5, 6], [6, 7, 8, 9, 10, 11], [11, 12, 13, 20, 21, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10], [10, 11, 12, 0, 1, 0]])
    np.testing.assert_array_equal(rows["segment_ids"][2], [1, 1, 1, 2, 2, 0])
    batch = packing.as_batch(rows)
    np.testing.assert_array_equal(batch["loss_weights"], [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 0]])
    assert batch["loss_weights"].sum() == 10 + 1  # the 10 completion targets and 20 -> 21


# -- fine-tuning records -----------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def trained_text(doc: Document) -> str:
    """The document's bytes, untrained ones shown as '_'."""
    return "".join(chr(t) if m else "_" for t, m in zip(doc.tokens, doc.mask))


def test_chat_records_train_on_the_assistant_replies_only():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    doc = records.chat_document(messages, records.ChatTemplate(CHAT_TEMPLATE), BYTES, "record 0")
    text = bytes(doc.tokens.astype(np.uint8)).decode()
    assert text == "<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>hello<|end|><|user|>2+2?<|end|>" \
                   "<|assistant|>4<|end|>"
    # the replies and their end-of-turn markers, never the headers that announce them
    assert trained_text(doc).replace("_", " ").split() == ["hello<|end|>", "4<|end|>"]


def test_prompt_completion_records_train_on_the_completion_and_eos():
    tokenizer = dataclasses.replace(BYTES, bos=1, eos=2)
    doc = records.prompt_completion("Q: 2+2? A:", " 4", tokenizer)
    assert doc.tokens[0] == 1 and doc.tokens[-1] == 2
    np.testing.assert_array_equal(doc.mask, [0] * 11 + [1, 1, 1])


def test_a_template_that_does_not_render_prefix_by_prefix_is_refused():
    reversed_order = "{% for m in messages|reverse %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match="record 3: the chat template does not render the conversation prefix"):
        records.chat_document(messages, records.ChatTemplate(reversed_order), BYTES, "record 3")


def test_bad_records_name_the_record_and_the_missing_field(tmp_path):
    path = tmp_path / "ft.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    assert sources.record_kind(path) == sources.PROMPT_COMPLETION
    documents = records.LazyDocuments(str(path), None)  # checked when opened: the bad record is left out, named
    assert len(documents) == 1 and "line 2 has no field 'completion' (it has 'prompt')" in documents.bad[0]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]}) + "\n")
    with pytest.raises(ValueError, match="line 1: message 2 must have text fields 'role' and 'content'"):
        RecordIndex(path, None).records(0, 1, sources.MESSAGES)
    with pytest.raises(ValueError, match="fine-tuning records, trained on their completions only"):
        packing_of(str(path), "windows")
    np.save(tmp_path / "t.npy", np.arange(10))
    with pytest.raises(ValueError, match="is a token file: it has no document boundaries"):
        packing_of(str(tmp_path / "t.npy"), "documents")
    assert packing_of(str(tmp_path / "t.npy"), None) == "windows" and packing_of(str(path), None) == "documents"


def test_train_packs_a_chat_jsonl_end_to_end(tmp_path, capsys):
    """`jaxpar train --data chat.jsonl --tokenizer ...` on a tiny tokenizer with a chat template, then `jaxpar eval`."""
    tokenizer = tiny_tokenizer(tmp_path)
    chats = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}"},
                           {"role": "assistant", "content": f"it is {2 * i}"}]} for i in range(60)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    metrics = tmp_path / "m.jsonl"
    common = ["--mesh", "data=8", "--batch-size", "8", "--seq-len", "32", "--tokenizer", str(tokenizer)]
    code = main(["train", *common, "--steps", "3", "--eval-every", "3", "--data", str(data), "--metrics",
                 str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt")])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert code == 0 and len(rows) == 3 and np.isfinite(rows[-1]["eval_loss"]), capsys.readouterr().err
    capsys.readouterr()
    code = main(["eval", "--checkpoint-dir", str(tmp_path / "ckpt"), "--data", str(data), "--seq-len", "32",
                 "--tokenizer", str(tokenizer), "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and abs(result["eval_loss"] - rows[-1]["eval_loss"]) < 1e-4
    # `jaxpar generate --chat`: the prompt as the template writes it for a reply, stopped at its end of turn
    generate = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), "--max-new-tokens", "6", "--json"]
    assert main([*generate, "--tokenizer", str(tokenizer), "--chat", "--prompt", "what is 3 plus 3"]) == 0
    chat = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    end = 5  # <|end|>
    assert chat["prompt_tokens"] == [[0, 3, 6, 7, 13, 8, 13, end, 4]] and chat["eos"] == end
    assert main([*generate, "--tokenizer", str(tokenizer), "--eos", str(end),
                 "--prompt", "<s><|user|>what is 3 plus 3<|end|><|assistant|>"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["prompt_tokens"] == chat["prompt_tokens"] and plain["tokens"] == chat["tokens"]
    assert plain["completions"] == chat["completions"]
    assert main([*generate, "--chat", "--prompt", "hi"]) == 2
    assert "needs --tokenizer" in capsys.readouterr().err


def test_the_end_of_turn_is_what_the_template_writes_after_a_reply(tmp_path):
    """`generate --chat` stops there; a template that writes nothing after a reply ends at the EOS."""
    from jaxpar.data.tokenize import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_tokenizer(tmp_path)))
    assert records.ChatTemplate(CHAT_TEMPLATE).end_of_turn(tokenizer) == 5  # <|end|>
    llama3 = ("{% for m in messages %}<|user|>{{ m.role }}<|assistant|>\n\n{{ m.content }}<|end|>{% endfor %}"
              "{% if add_generation_prompt %}<|user|>assistant<|assistant|>\n\n{% endif %}")
    assert records.ChatTemplate(llama3).end_of_turn(tokenizer) == 5
    bare = "{% for m in messages %}{{ m.content }} {% endfor %}"
    assert records.ChatTemplate(bare).end_of_turn(tokenizer) == tokenizer.eos == 1


def tiny_tokenizer(folder):
    """A word-level tokenizer.json with BOS/EOS and a chat template in its tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "what", "is", "plus", "it",
             *map(str, range(200))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ bos_token }}" + CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


# -- equivalence with each document run on its own --------------------------------------


def random_documents(rng, count, masked: bool):
    """Documents of 2..8 tokens, every fifth of 20..30 (longer than a row of 17); fine-tuning ones mask a prompt
    of 1..3 tokens."""
    docs = []
    for i in range(count):
        n = int(rng.integers(20, 31) if i % 5 == 2 else rng.integers(2, 9))
        mask = (np.arange(n) >= rng.integers(1, 4)).astype(np.float32) if masked else None
        docs.append(Document(rng.integers(1, CONFIG.vocab, n), mask))
    return docs


def packed_batch(masked: bool, seed: int):
    rng = np.random.default_rng(seed)
    docs = random_documents(rng, 40, masked)
    rows = packing.pack(docs, CONFIG.seq_len)
    assert rows["tokens"].shape[0] >= ROWS
    batch = packing.as_batch({k: v[:ROWS] for k, v in rows.items()})
    assert (batch["segment_ids"].max(axis=1) > 1).sum() >= 4  # most rows hold several documents
    assert batch["loss_weights"].sum() < (batch["segment_ids"] > 0).sum()  # boundaries (and prompts) weigh 0
    return batch


@pytest.fixture(scope="module")
def prepared():
    model, state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optax.sgd(0.1), single_device_plan())
    params = copy_state(state.params)
    batches = {"documents": packed_batch(False, 1), "fine-tuning": packed_batch(True, 2)}
    want = {name: jax.device_get(jax.jit(jax.value_and_grad(
        lambda p, b: reference_lib.document_loss(p, b, CONFIG)[0]))(params, reference_lib.documents_alone(batch)))
        for name, batch in batches.items()}
    return model, params, batches, want


_COMPILED = {}


def compiled_gradients(model, mesh: str, options: tuple):
    """Loss and gradients of (params, batch) under the plan, jitted once for every batch of this shape."""
    if (mesh, options) not in _COMPILED:
        _COMPILED[mesh, options] = _gradients(model, mesh, options)
    return _COMPILED[mesh, options]


def _gradients(model, mesh: str, options: tuple):
    size = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    plan = Plan.create(mesh, devices=jax.devices()[:size], **dict(options))

    @jax.jit
    def compute(p, b):
        loss, _, grads, _ = loss_and_grads(model, lambda m, batch: m(batch), p, b, plan)
        return loss, grads

    def run(params, batch):
        params = to_pipeline_order(copy_state(params), model.logical, plan)
        params = jax.device_put(params, plan.shardings(plan.param_specs(model.logical)))
        batch = jax.device_put({k: np.asarray(v) for k, v in batch.items()}, plan.sharding(plan.batch_spec(2)))
        with plan.activate(), bubble_fill(float("nan")):  # a pipeline bubble leaking into the loss shows as NaN
            loss, grads = jax.device_get(compute(params, batch))
        return loss, to_natural_order(grads, model.logical, plan)

    return run


# Both batches share each mesh's compiled step (same shapes), so the fine-tuning batch costs a run, not a compile.
MESHES = [
    ("data=8", ()),
    ("data=2,tensor=2,pipe=2", ()),  # 1f1b: the residual ring keeps each microbatch's document fields
    ("data=2,tensor=2,pipe=2", (("schedule", "gpipe"), ("grad_accum", 2))),
    ("data=2,tensor=2,pipe=2", (("schedule", "zb-h1"), ("tensor_form", "explicit"), ("sequence_parallel", True))),
    ("data=2,context=4", (("context_form", "all-gather"),)),
    ("data=2,context=4", (("context_form", "ring"),)),
    ("data=2,context=2,pipe=2", (("context_form", "ring"),)),  # the head's weights in context order, per stage
    ("data=8", (("zero", 3),)),
    # the loss over chunks of every n-th token (jaxpar.parallel.loss_chunks), in each form that splits the sequence
    ("data=8", (("zero", 3), ("loss_chunks", 4))),
    ("data=2,tensor=4", (("loss_chunks", 4), ("sequence_parallel", True))),
    ("data=2,tensor=4", (("loss_chunks", 2), ("tensor_form", "explicit"), ("sequence_parallel", True))),
    ("data=2,context=4", (("loss_chunks", 2), ("context_form", "ring"))),
    ("data=2,tensor=2,pipe=2", (("loss_chunks", 2), ("tensor_form", "explicit"))),
]
CASES = [(mesh, options, kind) for mesh, options in MESHES for kind in ("documents", "fine-tuning")]


@pytest.mark.parametrize("mesh, options, kind", CASES,
                         ids=[f"{m}{''.join(f'-{k}={v}' for k, v in o)}-{kind}" for m, o, kind in CASES])
def test_packed_batch_matches_each_document_on_its_own(prepared, mesh, options, kind):
    model, params, batches, want = prepared
    loss, grads = compiled_gradients(model, mesh, options)(params, batches[kind])
    want_loss, want_grads = want[kind]
    print(f"{mesh} {dict(options)} {kind}: loss rel error {abs(loss / want_loss - 1):.2e}, "
          f"grads {max_relative_error(grads, want_grads):.2e}")
    assert abs(loss / want_loss - 1) <= 1e-5
    assert max_relative_error(grads, want_grads) <= 1e-5


def test_a_loss_that_never_reads_the_loss_weights_is_refused(prepared):
    model, params, batches, _ = prepared
    plan = Plan.create("data=8")
    state = init_state(lambda: Llama(CONFIG, nnx.Rngs(0)), optax.sgd(0.1), plan)[1]
    own_loss = lambda m, b: jnp.mean(m.embed(b["inputs"]) ** 2)  # noqa: E731 - ignores the documents' weights
    step = make_train_step(model, own_loss, optax.sgd(0.1), plan)
    with pytest.raises(ValueError, match="carries loss_weights .* but the model's loss never read them"):
        step(state, {k: jnp.asarray(v) for k, v in batches["documents"].items()})

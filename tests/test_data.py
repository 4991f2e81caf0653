"""Batches are a pure function of (seed, step), assembled from process-local rows; bad data is named."""

import json

import jax
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.core.plan import Plan
from jaxpar.data.tokenize import training_streams
from jaxpar.data.tokens import BadBatch, Batches, check_vocab, default_corpus, global_batch, load_tokens
from jaxpar.data.mixture import MixtureBatches
from jaxpar.data.record_index import read_documents


def test_default_corpus_is_real_text():
    tokens = default_corpus()
    text = tokens[:20000].tobytes().decode("utf-8")
    assert tokens.size > 100_000 and " the " in text


def test_batches_are_deterministic_and_indexable():
    a, b = Batches(default_corpus(), 8, 16, seed=1), Batches(default_corpus(), 8, 16, seed=1)
    assert np.array_equal(a[5]["inputs"], b[5]["inputs"])
    assert not np.array_equal(a[5]["inputs"], a[6]["inputs"])
    assert np.array_equal(a[5]["inputs"][:, 1:], a[5]["targets"][:, :-1])
    assert np.array_equal(a.rows(5, 2, 6)["targets"], a[5]["targets"][2:6])


def test_global_batch_is_the_same_on_any_mesh():
    batches = Batches(default_corpus(), 8, 16, seed=2)
    for mesh in ("data=8", "data=2,tensor=4", "data=2,expert=2,tensor=2"):
        plan = Plan.create(mesh)
        arrays = global_batch(batches, 3, plan.sharding(plan.batch_spec(2)))
        assert np.array_equal(jax.device_get(arrays["inputs"]), batches[3]["inputs"])


def test_text_folder_and_token_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.md").write_text("more text " * 20)
    assert load_tokens(tmp_path).size > 300
    np.save(tmp_path / "t.npy", np.arange(100, dtype=np.int32))
    assert load_tokens(tmp_path / "t.npy")[-1] == 99
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert load_tokens(tmp_path / "t.bin").size == 50


def test_bad_data_is_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        load_tokens(tmp_path / "empty.txt")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        load_tokens(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match=r"'t.npy' holds token ids outside the model's vocabulary \[0, 256\): 256,"):
        check_vocab(np.arange(1000), 256, "t.npy")


# -- document sources, mixtures, the per-batch vocabulary check ---------------------------------------

DOCS = ["first document", "the second one", "a third"]


def write_sources(folder):
    """The same three documents as JSON lines, Parquet and a `datasets` save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "d.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    pq.write_table(pa.table({"text": DOCS}), folder / "d.parquet")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(folder / "saved"))
    return [folder / "d.jsonl", folder / "d.parquet", folder / "saved"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A tiny Hugging Face tokenizer.json with <s> and </s>, whose post-processor already adds <s> (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for t in DOCS for w in t.split()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path, vocab


def test_document_sources_read_the_same_documents(sources):
    for path in sources:
        assert read_documents(path) == DOCS, path
        stream = training_streams(str(path), None, 256)[0][1]
        assert stream.tobytes() == "\n\n".join(DOCS).encode()  # bytes: documents separated by a blank line


def test_documents_without_a_tokenizer_are_what_the_readme_says(sources):
    """No BOS/EOS among 256 byte ids: each document is its bytes and a blank line, the source's last without one,
    whether packed as documents or read as one stream for windows."""
    from pathlib import Path

    from jaxpar.data.records import LazyDocuments

    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert ('Without a tokenizer there is no BOS or EOS (all 256 byte ids are bytes): a document is its UTF-8 bytes '
            'followed by a blank line, `"\\n\\n"` (the last of a source excepted)') in readme
    packed = [bytes(d.tokens.astype(np.uint8)) for d in LazyDocuments(str(sources[0]), None).documents(0, 3)]
    assert packed == [b"first document\n\n", b"the second one\n\n", b"a third"]
    assert training_streams(str(sources[0]), None, 256)[0][1].tobytes() == b"".join(packed)


def test_documents_get_bos_and_eos_once(sources, word_tokenizer):
    path, vocab = word_tokenizer
    ids = training_streams(str(sources[0]), str(path), 64)[0][1].tolist()
    expected = []
    for text in DOCS:
        expected += [1, *[vocab[w] for w in text.split()], 2]
    assert ids == expected


def test_text_field(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    assert training_streams(str(tmp_path / "c.jsonl"), None, 256, text_field="body")[0][1].tobytes() == b"hello"
    with pytest.raises(ValueError, match=r"line 1 has no field 'text' \(it has 'body'\); choose the field with DataSpec\(text_field=\.\.\.\)"):
        training_streams(str(tmp_path / "c.jsonl"), None, 256)


def test_mixture_is_deterministic_and_weighted():
    a, b = np.zeros(1000, np.uint16), np.ones(1000, np.uint16)
    mix = MixtureBatches((a, b), (0.7, 0.3), ("a", "b"), 1000, 8, seed=3, vocab=256)
    again = MixtureBatches((a, b), (0.7, 0.3), ("a", "b"), 1000, 8, seed=3, vocab=256)
    rows = mix[2]["inputs"]
    assert np.array_equal(rows, again[2]["inputs"]) and not np.array_equal(rows, mix[3]["inputs"])
    share = (rows[:, 0] == 0).mean()
    assert 0.65 < share < 0.75, share  # 1000 rows, 0.7 expected (sd 0.014)
    assert np.array_equal(mix.rows(2, 100, 300)["targets"], mix[2]["targets"][100:300])
    small = MixtureBatches((np.arange(300) % 256, default_corpus()), (1.0, 2.0), ("a", None), 8, 16, seed=1, vocab=256)
    plan = Plan.create("data=2,tensor=4")
    arrays = global_batch(small, 4, plan.sharding(plan.batch_spec(2)))
    assert np.array_equal(jax.device_get(arrays["inputs"]), small[4]["inputs"])


def test_batches_check_token_ids_per_batch():
    tokens = np.arange(100, dtype=np.int32)
    tokens[50] = 300
    batches = Batches(tokens, 8, 16, seed=0, vocab=256, source="t.npy")
    bad = next(s for s in range(100) if any(st <= 50 <= st + 16 for st in batches.starts(s)))
    with pytest.raises(BadBatch, match=rf"--data 't.npy' holds token ids outside the model's vocabulary \[0, 256\): "
                                       rf"300 \(smallest \d+, largest 300\) in the batch of step {bad};"):
        batches[bad]
    clean = next(s for s in range(100) if not any(st <= 50 <= st + 16 for st in batches.starts(s)))
    assert batches[clean]["inputs"].max() < 256  # only the batches holding the bad id are refused


@pytest.mark.parametrize("spec, message", [
    ("{d}/missing.jsonl", "does not exist"),
    ("{d}/d.jsonl:0", "the weight of '{d}/d.jsonl' is 0; weights must be positive and finite"),
    ("{d}/d.jsonl:-1,{d}/d.parquet:1", "is -1; weights must be positive"),
    ("{d}/d.jsonl:x", "the weight of '{d}/d.jsonl' is 'x', not a number"),
    ("{d}/d.xyz", "unknown kind of file '.xyz'"),
    ("{d}/nofield.jsonl", "has no field 'text' (it has 'body')"),
    ("{d}/d.parquet", "has no field 'text' (it has 'body')"),
])
def test_bad_sources_are_refused_by_name(tmp_path, capsys, spec, message):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "d.xyz").write_text("x")
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    if "parquet" in spec and ":" not in spec:
        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    else:
        pq.write_table(pa.table({"text": ["x" * 100]}), tmp_path / "d.parquet")
    code = main(["train", "--mesh", "data=8", "--batch-size", "8", "--seq-len", "16", "--steps", "1",
                 "--data", spec.format(d=tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message.format(d=tmp_path) in " ".join(err.split()) and "Traceback" not in err, err


def test_train_on_jsonl(tmp_path, capsys):
    lines = [json.dumps({"text": f"document number {i} says something about jax."}) for i in range(40)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--mesh", "data=8", "--batch-size", "8", "--seq-len", "16", "--steps", "2",
                 "--data", f"{tmp_path / 't.jsonl'}:0.5,{tmp_path / 't.jsonl'}", "--metrics", str(metrics)])
    assert code == 2  # one source twice is refused
    code = main(["train", "--mesh", "data=8", "--batch-size", "8", "--seq-len", "16", "--steps", "2",
                 "--data", str(tmp_path / "t.jsonl"), "--metrics", str(metrics)])
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert code == 0 and len(losses) == 2 and all(np.isfinite(losses)), capsys.readouterr().err


def _documents_jsonl(tmp_path, count=40):
    docs = [f"document {i:02d} " + "x" * (20 + 7 * (i % 5)) for i in range(count)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def test_held_out_split_is_whole_documents(tmp_path, sources, word_tokenizer):
    """A document source is cut at a document start: the held-out split is the last documents, whole."""
    from jaxpar.data.holdout import HOLDOUT, split_tokens

    path, docs = _documents_jsonl(tmp_path)
    _, tokens, _, starts = training_streams(str(path), None, 256)[0]
    assert np.array_equal(starts, np.cumsum([0] + [len(d) + 2 for d in docs[:-1]]))
    train, heldout = split_tokens(tokens, document_starts=starts)
    held_docs = heldout.tobytes().decode().split("\n\n")
    assert held_docs == docs[-len(held_docs):] and 1 <= len(held_docs) < len(docs)
    assert train.tobytes().decode() == "\n\n".join(docs[:-len(held_docs)]) + "\n\n"
    assert abs(heldout.size / tokens.size - HOLDOUT) < 0.05
    tok_path, vocab = word_tokenizer  # with BOS/EOS: the held-out document is the last one, both kept
    _, tokens, _, starts = training_streams(str(sources[0]), str(tok_path), 64)[0]
    assert split_tokens(tokens, document_starts=starts)[1].tolist() == [1, vocab["a"], vocab["third"], 2]


def test_held_out_split_of_a_token_file_is_unchanged_and_one_document_is_refused(tmp_path):
    from jaxpar.data.holdout import split_tokens

    tokens = np.arange(1000, dtype=np.uint16)
    train, heldout = split_tokens(tokens)
    assert train.size == 950 and np.array_equal(heldout, tokens[950:])
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "only " * 200}) + "\n")
    _, tokens, _, starts = training_streams(str(tmp_path / "one.jsonl"), None, 256)[0]
    with pytest.raises(ValueError, match=r"--data 'one.jsonl' holds one document; evaluation holds out whole documents"):
        split_tokens(tokens, document_starts=starts, source="one.jsonl")


def test_prefetched_batches_come_in_step_order_and_raise_at_their_step():
    from jaxpar.data.prefetch import prefetched

    def read(step):
        if step == 7:
            raise BadBatch(f"bad batch of step {step}")
        return step * 10

    for workers in (0, 1, 2):
        got = []
        with pytest.raises(BadBatch, match="step 7"):
            for value in prefetched(read, range(3, 12), workers):
                got.append(value)
        assert got == [30, 40, 50, 60], workers
    batches = prefetched(lambda s: s, range(100), 2)
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    batches.close()  # an early stop drops the read-ahead
    with pytest.raises(ValueError, match="data workers must be 0 or more, got -1"):
        next(prefetched(read, range(3), -1))


"""Packed documents read lazily (jaxpar.data.block_packing): start-up reads an index, blocks are packed when needed.

Every document's tokens are distinct ids here, so a target names the document
and place it came from: an epoch's rows must train each of them exactly once.
"""

import json
import math

import numpy as np
import pytest

from jaxpar.data import records
from jaxpar.data.tokenize import BYTES, encode_documents
from jaxpar.data.packed import documents_of, packed_batches
from jaxpar.data.block_packing import BlockBatches, InMemoryDocuments
from jaxpar.data.record_index import read_documents
from jaxpar.data.packing import Document, split_stream

SEQ = 15


def distinct_documents(count=60, seed=0):
    """Documents of distinct ids (some longer than a row of 16, so split into pieces)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 40, count)
    ids = np.arange(1, sizes.sum() + 1)
    return [Document(piece) for piece in np.split(ids, np.cumsum(sizes)[:-1])]


def batches_of(docs, seed=3, batch_size=4, block_documents=7):
    return BlockBatches(InMemoryDocuments(docs), batch_size, SEQ, seed, block_documents=block_documents)


def epoch_targets(batches) -> np.ndarray:
    """The trained targets of the first epoch's rows (positions 0 .. rows per epoch - 1)."""
    rows = batches.rows_per_epoch
    steps = math.ceil(rows / batches.batch_size)
    parts = [batches.rows(s) for s in range(steps)]
    targets = np.concatenate([p["targets"] for p in parts])[:rows]
    weights = np.concatenate([p["loss_weights"] for p in parts])[:rows]
    return targets[weights > 0]


def test_every_document_is_trained_once_per_epoch_pieces_included():
    docs = distinct_documents()
    batches = batches_of(docs)
    expected = np.concatenate([d.tokens[1:] for d in docs])  # every token but a document's first is a target once
    np.testing.assert_array_equal(np.sort(epoch_targets(batches)), np.sort(expected))
    assert batches.steps_for(1) == math.ceil(batches.rows_per_epoch / 4)
    second = [batches.rows(s)["targets"] for s in range(batches.steps_for(1), batches.steps_for(2))]
    assert not np.array_equal(second[0], batches.rows(0)["targets"])  # a new order each epoch


def test_batches_are_a_function_of_seed_and_step_and_rows_lo_hi_are_the_batch_slice():
    docs = distinct_documents()
    first = batches_of(docs)
    whole = [first.rows(s) for s in range(12)]
    resumed = batches_of(docs)  # another process, or a resumed run: it reads step 9's rows 1:3 first
    part = resumed.rows(9, 1, 3)
    for name, value in part.items():
        np.testing.assert_array_equal(value, whole[9][name][1:3])
    for step in (11, 4):
        for name in whole[step]:
            np.testing.assert_array_equal(resumed.rows(step)[name], whole[step][name])
    from jaxpar.data.prefetch import prefetched

    threaded = batches_of(docs, block_documents=3)  # read-ahead workers packing blocks at once
    alone = batches_of(docs, block_documents=3)
    for step, rows in enumerate(prefetched(threaded.rows, range(12), workers=3)):
        np.testing.assert_array_equal(rows["targets"], alone.rows(step)["targets"])
    other = batches_of(docs, seed=4)
    assert not all(np.array_equal(other.rows(s)["targets"], whole[s]["targets"]) for s in range(3))
    assert set(whole[0]) == {"inputs", "targets", "segment_ids", "positions", "loss_weights"}


def test_a_process_packs_only_the_blocks_up_to_its_rows():
    docs = distinct_documents(count=140)
    batches = batches_of(docs, block_documents=7)  # 20 blocks
    packed = []
    read = batches.source.documents
    batches.source.documents = lambda lo, hi: packed.append(lo // 7) or read(lo, hi)
    batches.rows(0)
    order = batches._order(0)
    last = max(order.index(b) for _, b, _ in batches.locations(0))
    assert sorted(packed) == sorted(order[:last + 1]) and len(packed) < batches.blocks


@pytest.fixture
def jsonl(tmp_path):
    texts = [f"document {i} " + "abc" * (i % 13) for i in range(50)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts[:20]) + "\n\n"
                    + "\n".join(json.dumps({"text": t}) for t in texts[20:]) + "\n")
    return path, texts


def test_start_up_reads_the_index_only_and_documents_match_the_whole_read(jsonl, monkeypatch):
    path, texts = jsonl
    calls = []
    encode = records.encode_documents
    monkeypatch.setattr(records, "encode_documents", lambda *a: calls.append(1) or encode(*a))
    documents = documents_of(str(path), None, 256)
    batches = packed_batches(documents, 4, SEQ, 0, 256, str(path))
    assert len(documents) == 50 and not calls  # the blank line is no record; nothing tokenized yet
    batches.rows(0)
    assert calls
    eager = split_stream(*encode_documents(read_documents(path), BYTES))
    lazy = documents.documents(0, 13) + documents.documents(13, 50)  # blocks end anywhere, documents do not change
    assert len(lazy) == len(eager)
    for a, b in zip(lazy, eager):
        np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kind", ["parquet", "datasets", "folder"])
def test_each_kind_of_source_reads_by_range(tmp_path, kind):
    texts = [f"text number {i}" for i in range(9)]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=4)
    elif kind == "datasets":
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
    else:
        path = tmp_path / "folder"
        path.mkdir()
        for i, t in enumerate(texts):
            (path / f"{i:02d}.txt").write_text(t)
    documents = records.LazyDocuments(str(path), None)
    assert len(documents) == 9
    got = [bytes(d.tokens[:len(t)].astype(np.uint8)).decode() for d, t in zip(documents.documents(3, 8), texts[3:8])]
    assert got == texts[3:8]


def test_fine_tuning_records_read_lazily_match_the_whole_read(tmp_path):
    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}"} for i in range(10)]
    path = tmp_path / "tune.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    documents = records.LazyDocuments(str(path), None)
    for doc, row in zip(documents.documents(2, 10), rows[2:]):
        expected = records.prompt_completion(row["prompt"], row["completion"], BYTES)
        np.testing.assert_array_equal(doc.tokens, expected.tokens)
        np.testing.assert_array_equal(doc.mask, expected.mask)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    documents = records.LazyDocuments(str(path), None)  # checked when opened: the bad record is left out, named
    assert len(documents) == 1 and len(documents.bad) == 1 and "line 2 has no field 'completion'" in documents.bad[0]


def test_train_epochs_of_a_jsonl_counts_the_packed_rows(jsonl, tmp_path, capsys):
    """`jaxpar train --data docs.jsonl --epochs 1`: the steps are the epoch's packed rows over the batch size."""
    from jaxpar.cli import main

    path, _ = jsonl
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--mesh", "data=8", "--batch-size", "8", "--seq-len", str(SEQ), "--data", str(path),
                 "--epochs", "1", "--metrics", str(metrics)])
    printed = capsys.readouterr()
    rows_per_epoch = packed_batches(documents_of(str(path), None, 256), 8, SEQ, 0, 256, str(path)).rows_per_epoch
    steps = math.ceil(rows_per_epoch / 8)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert code == 0 and len(lines) == steps, printed.err
    assert "50 documents in 1 blocks" in printed.out and f"{rows_per_epoch:,} rows, 1 epochs = {steps:,} steps" \
        in printed.out.replace("\n", "")
    assert lines[-1]["epoch"] == pytest.approx(steps * 8 / rows_per_epoch)

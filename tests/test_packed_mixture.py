"""A weighted mixture of packed sources (jaxpar.train.packed_mixture): exact weights per chunk, each source's
own epochs, batches a pure function of (seed, step)."""

import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.run.packed import packing_of
from jaxpar.train.block_packing import BlockBatches, InMemoryDocuments
from jaxpar.train.packed_mixture import CHUNK, PackedMixture
from jaxpar.train.packing import Document

SEQ = 15


def source(first_id: int, count: int, seed: int) -> BlockBatches:
    """Packed documents of distinct ids from `first_id` (so a target names its source and place)."""
    sizes = np.random.default_rng(seed).integers(2, 30, count)
    ids = first_id + np.arange(sizes.sum())
    docs = [Document(piece) for piece in np.split(ids, np.cumsum(sizes)[:-1])]
    return BlockBatches(InMemoryDocuments(docs), 8, SEQ, seed=5, block_documents=6)


@pytest.fixture(scope="module")
def mixture():
    return PackedMixture([source(1, 40, 0), source(10_000, 30, 1)], [0.7, 0.3], ["a", "b"], batch_size=64, seed=2)


def test_each_source_is_read_in_its_own_order_at_exact_weights(mixture):
    """Source j's k-th row in the mixture is row k of source j's own sequence, and a chunk holds n_j of j."""
    assert list(mixture.quota) == [round(0.7 * CHUNK), CHUNK - round(0.7 * CHUNK)]
    drawn = [mixture.assignment(p) for p in range(CHUNK)]
    assert [sum(j == s for j, _ in drawn) for s in (0, 1)] == list(mixture.quota)
    steps = 2 * CHUNK // mixture.batch_size
    rows = [mixture.rows(s) for s in range(steps)]
    inputs = np.concatenate([r["inputs"] for r in rows])
    origin = np.asarray([mixture.assignment(p)[0] for p in range(steps * mixture.batch_size)])
    for j, own in enumerate(mixture.sources):
        taken = inputs[origin == j]
        expected = own.rows_at(range(len(taken)), 0)["inputs"]
        assert np.array_equal(taken, expected), j
        assert ((taken >= 10_000) | (taken == 0)).all() == (j == 1)  # ids name the source (0: padding)


def test_batches_are_a_function_of_seed_and_step_and_rows_lo_hi_are_the_batch_slice(mixture):
    again = PackedMixture([source(1, 40, 0), source(10_000, 30, 1)], [0.7, 0.3], ["a", "b"], 64, seed=2)
    other = PackedMixture([source(1, 40, 0), source(10_000, 30, 1)], [0.7, 0.3], ["a", "b"], 64, seed=3)
    assert np.array_equal(again.rows(7, 20, 40)["segment_ids"], mixture.rows(7)["segment_ids"][20:40])
    assert np.array_equal(again[7]["inputs"], mixture[7]["inputs"])
    assert not np.array_equal(other[7]["inputs"], mixture[7]["inputs"])


def test_a_weight_too_small_for_a_chunk_is_refused():
    with pytest.raises(ValueError, match=r"give b no row in 1024: a source's weight must be at least 1/1024"):
        PackedMixture([source(1, 10, 0), source(10_000, 10, 1)], [1.0, 1e-4], ["a", "b"], 8)


def test_train_on_a_mixture_of_documents_records_and_a_token_file(tmp_path, capsys):
    """`--data a.jsonl:0.6,b.jsonl:0.2,c.npy:0.2` packs documents (the token file in pieces) and trains."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} about cats. " * (1 + i % 4)}) + "\n"
                                              for i in range(60)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}? ", "completion": f"answer {i}."}) + "\n"
                                              for i in range(30)))
    np.save(tmp_path / "c.npy", (np.arange(3000) % 250).astype(np.uint16))
    spec = f"{tmp_path}/a.jsonl:0.6,{tmp_path}/b.jsonl:0.2,{tmp_path}/c.npy:0.2"
    assert packing_of(spec, None) == "documents"
    np.save(tmp_path / "d.npy", (np.arange(3000) % 200).astype(np.uint16))
    assert packing_of(f"{tmp_path}/c.npy:0.5,{tmp_path}/d.npy:0.5", None) == "windows"  # token files only
    with pytest.raises(ValueError, match="mixes in fine-tuning records"):
        packing_of(spec, "windows")
    metrics = tmp_path / "m.jsonl"
    code = main(["train", "--mesh", "data=8", "--batch-size", "8", "--seq-len", "32", "--steps", "2", "--data", spec,
                 "--metrics", str(metrics)])
    assert code == 0, capsys.readouterr().err
    assert len(metrics.read_text().splitlines()) == 2

"""A weighted mixture of packed sources (jaxpar.data.packed_mixture): exact weights per chunk, each source's
own epochs, batches a pure function of (seed, step)."""

import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data.packed import packing_of
from jaxpar.data.block_packing import BlockBatches, InMemoryDocuments
from jaxpar.data.packed_mixture import CHUNK, PackedMixture
from jaxpar.data.packing import Document

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
                 "--metrics", str(metrics), "--eval-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt")])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 2 and "eval_loss" not in rows[0]
    names = [f"{tmp_path}/{n}" for n in ("a.jsonl", "b.jsonl", "c.npy")]
    losses = [rows[1][f"eval_loss/{n}"] for n in names]
    assert len(set(losses)) == 3 and all(np.isfinite(losses))
    assert rows[1]["eval_loss"] == pytest.approx(0.6 * losses[0] + 0.2 * losses[1] + 0.2 * losses[2], rel=1e-12)
    assert rows[1]["eval_tokens"] == sum(rows[1][f"eval_tokens/{n}"] for n in names)
    assert all(0 < rows[1][f"epoch/{n}"] < rows[1][f"epoch/{names[1]}"] for n in (names[0], names[2]))
    # `jaxpar eval` on the mixture holds out what training held out: the same figures from the checkpoint
    assert main(["eval", "--checkpoint-dir", str(tmp_path / "ckpt"), "--data", spec, "--seq-len", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("eval_loss", *(f"eval_loss/{n}" for n in names)):
        assert report[key] == pytest.approx(rows[1][key], rel=1e-5)
    assert report["eval_tokens"] == rows[1]["eval_tokens"]


def test_a_mixture_holds_out_each_source_whole_documents_and_a_token_file_tail(tmp_path):
    """--eval-every on a mixture: each source's held-out part (its last documents; a token file's tail) is never
    among the rows training reads; a windows mixture holds out each stream's tail."""
    from jaxpar.core.mesh import parse_mesh
    from jaxpar.core.plan import Plan
    from jaxpar.run.evaluate import Evaluator
    from jaxpar.data.holdout import HOLDOUT
    from jaxpar.run.training import TrainConfig, _evaluator, prepare

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}: " + "xy" * (i % 7)}) + "\n"
                                              for i in range(100)))
    np.save(tmp_path / "c.npy", (np.arange(4000) % 250).astype(np.uint16))
    np.save(tmp_path / "d.npy", (np.arange(2000) % 200).astype(np.uint16))
    plan = Plan.create(parse_mesh("data=8")[0])
    packed = prepare(TrainConfig(data=f"{tmp_path}/a.jsonl:0.5,{tmp_path}/c.npy:0.5", eval_every=1, batch_size=8,
                                 seq_len=32, steps=2), plan)
    a, c = packed.heldout
    assert (a.weight, c.weight) == (0.5, 0.5)
    assert len(a.data) == int(100 * HOLDOUT) and len(packed.batches.sources[0].source) == 100 - len(a.data)
    (stream,) = packed.batches.sources[1].source.documents(0, 1)
    (tail,) = c.data.documents(0, 1)
    assert stream.tokens.size + tail.tokens.size == 4000 and tail.tokens.size == int(4000 * HOLDOUT)
    params = packed.init().params
    figures = _evaluator(packed)(params)
    for held in packed.heldout:
        alone = Evaluator(packed.model, plan, held.windows(32, 8), 8)(params)
        assert figures[f"eval_loss/{held.name}"] == pytest.approx(alone["eval_loss"], rel=1e-6)

    import io

    from rich.console import Console

    from jaxpar.run.report import _epoch_text

    progress = _epoch_text(packed, Console(file=io.StringIO()))(2)  # the progress bar's text after step 2
    epochs = packed.batches.source_epochs(2)
    assert progress == f"  epoch a.jsonl {epochs[f'{tmp_path}/a.jsonl']:.2f} c.npy {epochs[f'{tmp_path}/c.npy']:.2f}"

    windows = prepare(TrainConfig(data=f"{tmp_path}/c.npy:0.7,{tmp_path}/d.npy:0.3", eval_every=1, batch_size=8,
                                  seq_len=32, steps=2), plan)
    assert [s.size for s in windows.batches.streams] == [3800, 1900]
    assert [h.data.size for h in windows.heldout] == [200, 100] and [h.weight for h in windows.heldout] == [0.7, 0.3]


def test_epochs_of_a_mixture_are_refused_and_each_source_reports_its_own(mixture, tmp_path):
    for source in mixture.sources:
        source.rows_per_epoch  # every count known: each source's epoch is exact
    for step in (3, 40):
        taken = mixture.taken(step * mixture.batch_size)
        assert sum(taken) == step * mixture.batch_size
        drawn = [mixture.assignment(p)[0] for p in range(step * mixture.batch_size)]
        assert taken == [drawn.count(j) for j in range(2)]
        assert mixture.source_epochs(step) == {name: n / source.rows_per_epoch for name, n, source
                                               in zip(mixture.names, taken, mixture.sources)}
    np.save(tmp_path / "c.npy", (np.arange(3000) % 250).astype(np.uint16))
    code = main(["train", "--data", f"{tmp_path}/c.npy:0.5,{tmp_path}/c.npy:0.5", "--epochs", "1"])
    assert code == 2

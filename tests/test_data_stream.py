"""jaxpar.data.stream, the one entry from a data spec to global batches: the batches `jaxpar train` read before it
(a token file's random windows, packed JSON lines documents, a mixture), laid out for the plan, start-up checks, and
get_state / set_state resuming bitwise mid-epoch."""

import json

import jax
import numpy as np
import pytest

import jaxpar
from data_walk import climbs, examples, walk
from jaxpar.core.plan import Plan
from jaxpar.data.packed import documents_of, packed_batches, packed_mixture
from jaxpar.data.stream import BatchStream, DataSpec, batch_stream

VOCAB, BATCH, SEQ = 256, 8, 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    tokens = folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, 3000).astype(np.uint16))
    documents = folder / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": f"record {i}: " + "word " * (2 + i % 9)}) + "\n"
                                 for i in range(60)))
    return {"tokens": str(tokens), "documents": str(documents)}


def host(batch: dict) -> dict:
    return {k: np.asarray(jax.device_get(v)) for k, v in batch.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_token_file_gives_the_seeds_random_windows_laid_out_for_the_plan(files):
    plan = Plan.create("data=4,tensor=2")
    stream = batch_stream(DataSpec(files["tokens"], seed=3), plan, BATCH, SEQ, VOCAB)
    tokens = np.load(files["tokens"])
    for step, batch in zip(range(3), stream):
        starts = np.random.default_rng([3, step]).integers(0, tokens.size - SEQ - 1, size=BATCH)  # as train/data did
        windows = np.stack([tokens[s: s + SEQ + 1] for s in starts]).astype(np.int32)
        assert batch["inputs"].sharding == plan.sharding(plan.batch_spec(2)) and batch["inputs"].dtype == np.int32
        assert same(host(batch), {"inputs": windows[:, :-1], "targets": windows[:, 1:]})
    assert stream.get_state()["position"] == 3 and stream.get_state()["order"] == "windows"


def test_packed_documents_are_the_packed_batches_train_read(files):
    plan = Plan.create("data=8")
    stream = batch_stream(DataSpec(files["documents"], seed=1), plan, BATCH, SEQ, VOCAB)
    before = packed_batches(documents_of(files["documents"], None, VOCAB), BATCH, SEQ, 1, VOCAB, files["documents"])
    for step, batch in zip(range(4), stream):
        got = host(batch)
        assert set(got) == {"inputs", "targets", "segment_ids", "positions", "loss_weights"}
        assert same(got, before.rows(step))


def test_a_mixture_is_the_packed_mixture_train_read(files):
    data = f"{files['documents']}:0.7,{files['tokens']}:0.3"
    stream = batch_stream(DataSpec(data, seed=2), Plan.create("data=8"), BATCH, SEQ, VOCAB)
    before, _ = packed_mixture(data, None, VOCAB, "text", BATCH, SEQ, 2)
    for step, batch in zip(range(4), stream):
        assert same(host(batch), before.rows(step))
    assert "block_rows" in stream.get_state()


@pytest.mark.parametrize("spec", [dict(epochs=True), dict()], ids=["token file epochs", "packed documents"])
def test_set_state_resumes_bitwise_mid_epoch(files, spec):
    plan = Plan.create("data=8")
    data = files["tokens"] if spec else files["documents"]
    stream = batch_stream(DataSpec(data, seed=5, **spec), plan, BATCH, SEQ, VOCAB)
    rows = len(stream.batches.table) if spec else stream.batches.rows_per_epoch
    middle = rows // BATCH + 1  # past the first epoch's end, inside the second epoch
    assert middle * BATCH % rows, "the saved position must fall mid-epoch"
    for _ in range(middle):
        next(stream)
    state = json.loads(json.dumps(stream.get_state()))  # as a checkpoint's metadata keeps it
    after = [host(next(stream)) for _ in range(3)]
    stream.close()
    fresh = batch_stream(DataSpec(data, seed=5, **spec), plan, BATCH, SEQ, VOCAB)
    fresh.set_state(state)
    assert fresh.position == middle and all(same(host(next(fresh)), b) for b in after)


def test_set_state_refuses_a_state_of_another_order(files):
    plan = Plan.create("data=8")
    windows = batch_stream(DataSpec(files["tokens"]), plan, BATCH, SEQ, VOCAB).get_state()
    epochs = batch_stream(DataSpec(files["tokens"], epochs=True), plan, BATCH, SEQ, VOCAB)
    with pytest.raises(ValueError, match=r"^step 7 read its data in another order \(order: windows -> epochs\)"):
        epochs.set_state(windows, "step 7")


def test_a_stream_stops_before_stop_and_reads_nothing_past_it(files):
    stream = batch_stream(DataSpec(files["tokens"]), Plan.create("data=8"), BATCH, SEQ, VOCAB)
    read = []
    stream.batch = lambda step: read.append(step) or step
    stream.seek(2, stop=5)
    assert list(stream) == [2, 3, 4] and sorted(read) == [2, 3, 4] and stream.position == 5


def test_bad_records_and_ids_are_refused_at_start_up(tmp_path, files, capsys):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(6)]
    lines[2] = '{"text": "cut off'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 3 is not JSON .*: DataSpec\(skip_bad_records=True\)$"):
        batch_stream(DataSpec(str(path)), Plan.create("data=8"), BATCH, 4, VOCAB)
    stream = batch_stream(DataSpec(str(path), skip_bad_records=True), Plan.create("data=8"), BATCH, 4, VOCAB)
    err = capsys.readouterr().err
    assert len(stream.batches.source) == 5 and "DataSpec(skip_bad_records=True): training without 1 bad record" in err
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 100\).*the first is token"):
        batch_stream(DataSpec(files["tokens"]), Plan.create("data=8"), BATCH, SEQ, 100)


def test_the_public_entry_and_the_walk_of_prepare_goes_down(tmp_path):
    assert jaxpar.batch_stream is batch_stream and jaxpar.DataSpec is DataSpec and jaxpar.BatchStream is BatchStream
    for name, config in examples(tmp_path).items():
        path = walk(config, Plan.create("data=8"))
        assert path[:2] == ["jaxpar.run.training", "jaxpar.data.stream"], (name, path)
        # prepare calls the stream once and goes on with its own work: the one step back up, to prepare itself.
        assert [b for _, b in climbs(path)] == ["jaxpar.run.training"], (name, climbs(path))


def test_the_readme_data_example_runs_as_written():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "batch_stream" in b]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["saved"] == {"position": 10, "seed": 0, "order": "windows",
                                  "drawn_by": "numpy default_rng([seed, step]) per step"}
    assert namespace["stream"].position == 10 and namespace["batch"]["inputs"].shape == (8, 128)


def test_the_api_is_answered_in_its_own_words_and_the_command_line_in_flags(tmp_path, files):
    """DataSpec's arguments, never flags the caller has not got; the same errors under `jaxpar.cli.main` name flags.
    And a foreign dict given to set_state is told what it lacks by name."""
    from jaxpar.core.spelling import as_flags

    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    plan = Plan.create("data=8")
    with pytest.raises(ValueError, match=r"has no field 'text' \(it has 'body'\); choose the field with "
                                         r"DataSpec\(text_field=\.\.\.\)"):
        batch_stream(DataSpec(str(tmp_path / "b.jsonl")), plan, BATCH, 4, VOCAB)
    with pytest.raises(ValueError, match=r"^DataSpec\(packing=\.\.\.\) must be one of documents, windows, got 'rows'"):
        batch_stream(DataSpec(files["tokens"], packing="rows"), plan, BATCH, SEQ, VOCAB)
    with pytest.raises(ValueError, match=r"token file: .* use DataSpec\(packing='windows'\), or"):
        batch_stream(DataSpec(files["tokens"], packing="documents"), plan, BATCH, SEQ, VOCAB)
    with as_flags():
        with pytest.raises(ValueError, match=r"^--packing must be one of documents, windows, got 'rows'"):
            batch_stream(DataSpec(files["tokens"], packing="rows"), plan, BATCH, SEQ, VOCAB)
        with pytest.raises(ValueError, match=r"choose the field with --text-field; .*: --skip-bad-records$"):
            batch_stream(DataSpec(str(tmp_path / "b.jsonl")), plan, BATCH, 4, VOCAB)
    stream = batch_stream(DataSpec(files["tokens"], epochs=True), plan, BATCH, SEQ, VOCAB)
    with pytest.raises(ValueError, match=r"^set_state: the data state given has no 'seed', 'order' \(it has "
                                         r"\['position', 'windows_seen'\]\); give it what BatchStream.get_state"):
        stream.set_state({"position": 3, "windows_seen": 48})

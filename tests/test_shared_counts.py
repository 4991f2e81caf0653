"""Block row counts shared between processes (jaxpar.data.shared_counts): each block counted by its owner only.

The processes here are threads, each with its own BlockBatches over the same
documents, and the coordination service's store is a dict behind a condition
variable; tests/test_multiprocess.py runs the real store across two processes.
"""

import threading

import numpy as np
import pytest

from jaxpar.data.block_packing import BlockBatches, InMemoryDocuments
from jaxpar.data.shared_counts import SharedCounts
from test_lazy_packing import SEQ, distinct_documents

BLOCK = 5


class DictStore:
    """The key-value store of one run, shared by its 'processes' (threads)."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def set(self, key, value):
        with self.changed:
            assert key not in self.values, f"{key} published twice"
            self.values[key] = value
            self.changed.notify_all()

    def try_get(self, key):
        with self.changed:
            return self.values.get(key)

    def wait(self, key, timeout_s):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_s):
                raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


class CountingDocuments(InMemoryDocuments):
    """Documents that note which blocks were read (tokenized)."""

    def __init__(self, documents):
        super().__init__(documents)
        self.read = []

    def documents(self, lo, hi):
        self.read.append(lo // BLOCK)
        return super().documents(lo, hi)


def process_batches(docs, store, process, processes, batch_size=6, wait_s=60):
    shared = None if store is None else SharedCounts(store, "test", process, processes, wait_s)
    return BlockBatches(CountingDocuments(docs), batch_size, SEQ, seed=5, block_documents=BLOCK, shared=shared)


def run_processes(docs, processes, steps, batch_size=6):
    """Each thread reads its slice of every global batch; returns (rows by process, blocks each tokenized)."""
    store, share = DictStore(), batch_size // processes
    loaders = [process_batches(docs, store, p, processes, batch_size) for p in range(processes)]
    rows, errors = [[] for _ in range(processes)], []

    def work(p):
        try:
            for step in steps:
                rows[p].append(loaders[p].rows(step, p * share, (p + 1) * share))
        except Exception as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(p,)) for p in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a process waits forever for a count"
    assert not errors, errors
    return rows, loaders


def test_processes_read_the_single_process_rows_and_tokenize_only_their_blocks_and_rows():
    docs = distinct_documents(count=200)  # 40 blocks of 5
    steps = [0, 1, 2, 7, 30]  # a resumed run jumps ahead: every block before its rows must be counted
    rows, loaders = run_processes(docs, 3, steps)
    alone = process_batches(docs, None, 0, 1)
    for p, loader in enumerate(loaders):
        for step, got in zip(steps, rows[p]):
            want = alone.rows(step, 2 * p, 2 * p + 2)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
        holding = {block for step in steps for _, block, _ in loader.locations(step, 2 * p, 2 * p + 2)}
        owned = {b for b in set(loader.source.read) if b % 3 == p}
        assert set(loader.source.read) <= owned | holding, p  # nobody else's block, unless it holds this one's rows
        assert len(set(loader.source.read)) < len(set(alone.source.read)), p
    counted = max(len(set(alone.source.read)), 1)
    tokenized = sum(len(set(loader.source.read)) for loader in loaders)
    assert tokenized < 2 * counted  # alone, each of the 3 would have tokenized ~all of them: 3x


def test_an_epoch_count_is_shared_and_every_owner_counts_its_own_blocks():
    docs = distinct_documents(count=60)  # 12 blocks
    store = DictStore()
    loaders = [process_batches(docs, store, p, 2) for p in range(2)]
    totals = [None, None]
    threads = [threading.Thread(target=lambda p=p: totals.__setitem__(p, loaders[p].rows_per_epoch)) for p in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert totals[0] == totals[1] == process_batches(docs, None, 0, 1).rows_per_epoch
    for p, loader in enumerate(loaders):
        assert sorted(set(loader.source.read)) == [b for b in range(12) if b % 2 == p]


def test_a_resumed_run_counts_nothing_already_counted_and_refuses_a_count_that_changed():
    docs = distinct_documents(count=200)
    first = process_batches(docs, None, 0, 1)
    expected = first.rows(25)
    saved = first.row_counts()
    assert -1 in saved and sum(n >= 0 for n in saved) == len(set(first.source.read))

    resumed = process_batches(docs, None, 0, 1)
    resumed.learn_saved_counts(saved, "the checkpoint of step 25")
    got = resumed.rows(25)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])
    holding = {block for _, block, _ in resumed.locations(25)}
    assert set(resumed.source.read) == holding  # only the blocks that hold the batch's rows were tokenized

    changed = list(saved)
    block = next(iter(holding))
    changed[block] += 1
    stale = process_batches(docs, None, 0, 1)
    stale.learn_saved_counts(changed, "the checkpoint of step 25")
    with pytest.raises(ValueError, match=rf"block {block} \(documents {block * BLOCK}:{(block + 1) * BLOCK}\).*"
                                         "checkpoint of step 25"):
        stale.rows(25)
    with pytest.raises(ValueError, match="counted 3 blocks"):
        process_batches(docs, None, 0, 1).learn_saved_counts(saved[:3], "the checkpoint of step 25")


def test_a_count_that_never_comes_names_the_block_and_its_owner():
    docs = distinct_documents(count=60)
    alone = process_batches(docs, DictStore(), 0, 2, wait_s=0.2)  # its partner, process 1, never starts
    with pytest.raises(RuntimeError, match=r"count of block \d+ of test, which process 1 packs"):
        alone.rows_per_epoch


def test_checkpoints_keep_the_counts_and_a_resume_on_changed_data_is_refused(tmp_path, capsys):
    import json

    from jaxpar.cli import main
    from jaxpar.train.checkpoint import Checkpoints

    data, run = tmp_path / "docs.jsonl", tmp_path / "run"
    texts = ["ab" * (i % 5 + 1) for i in range(600)]  # 3 blocks of 256
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    flags = ["--mesh", "data=8", "--batch-size", "8", "--seq-len", "16", "--data", str(data),
             "--checkpoint-dir", str(run)]
    assert main(["train", *flags, "--steps", "2"]) == 0
    checkpoints = Checkpoints(run, read_only=True)
    saved = checkpoints.metadata()["data"]["block_rows"]
    checkpoints.close()
    assert len(saved) == 3 and any(n > 0 for n in saved)

    texts[256 * saved.index(next(n for n in saved if n > 0))] = "long " * 400  # same count of documents, more rows
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    capsys.readouterr()
    assert main(["train", *flags, "--steps", "4"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "packs into" in err and "by the checkpoint of step 2" in err and "the data" in err, err

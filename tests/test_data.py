"""Batches are a pure function of (seed, step), assembled from process-local rows; bad data is named."""

import jax
import numpy as np
import pytest

from jaxpar.train.data import Batches, check_vocab, default_corpus, global_batch, load_tokens
from jaxpar.core.plan import Plan


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

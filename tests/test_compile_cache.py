"""The persistent compilation cache: a repeated run loads its step instead of compiling it, and says so."""

import os
from pathlib import Path

import jax
import pytest

from jaxpar import cli
from jaxpar.core import compile_cache

TRAIN = ["train", "--mesh", "data=8", "--steps", "2", "--batch-size", "8", "--seq-len", "32"]


@pytest.fixture
def session_cache():
    """Tests here point the cache elsewhere; the session's cache comes back after each."""
    yield
    compile_cache.use()
    assert jax.config.jax_compilation_cache_dir == os.environ[compile_cache.ENV]


def test_a_repeated_run_loads_its_step_from_the_cache(tmp_path, capsys, session_cache):
    cache = tmp_path / "cache"
    assert cli.main([*TRAIN, "--compile-cache", str(cache)]) == 0
    first = capsys.readouterr().out
    assert f"step compiled (compile cache {cache})" in " ".join(first.split())
    assert any(cache.iterdir()), "the compiled step was not written"
    assert cli.main([*TRAIN, "--compile-cache", str(cache)]) == 0
    second = capsys.readouterr().out
    assert f"step loaded from the compile cache {cache}" in " ".join(second.split())
    losses = [[line.split()[3] for line in out.splitlines() if line.startswith("step ") and "loss" in line]
              for out in (first, second)]
    assert losses[0] and losses[0] == losses[1]


def test_off_says_so(session_cache):
    assert compile_cache.use("off") is None
    assert jax.config.jax_compilation_cache_dir is None
    watch = compile_cache.Watch()
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0))
    assert watch.source() == "compiled (the compile cache is off)"


def test_a_directory_that_cannot_be_made_is_one_line(tmp_path, capsys, session_cache):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main([*TRAIN, "--compile-cache", str(blocker / "cache")]) == 2
    err = capsys.readouterr().err
    assert f"--compile-cache {blocker / 'cache'}: cannot make the directory" in " ".join(err.split())
    assert "Traceback" not in err


def test_where_the_cache_lives(session_cache, tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compile_cache.resolve("off", environ) is None
    assert compile_cache.resolve(str(tmp_path / "x"), {compile_cache.ENV: "off"}) == tmp_path / "x"  # the flag wins
    assert compile_cache.resolve(None, {compile_cache.ENV: "OFF"}) is None
    assert compile_cache.resolve(None, {compile_cache.ENV: str(tmp_path / "y")}) == tmp_path / "y"
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax's"))  # a directory given to JAX itself
    assert compile_cache.resolve(None, environ) == tmp_path / "jax's"
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.resolve(None, environ) == Path(tmp_path) / "jaxpar" / "xla"

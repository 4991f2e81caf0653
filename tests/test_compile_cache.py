"""The persistent compilation cache: a repeated run loads its step instead of compiling it, and says so."""

import os
import pickle
from pathlib import Path

import jax
import pytest

from jaxpar import cli
from jaxpar.core import compile_cache, executables
from jaxpar.train.step import Step

TRAIN = ["train", "--mesh", "data=8", "--steps", "2", "--batch-size", "8", "--seq-len", "32"]


@pytest.fixture
def session_cache():
    """Tests here point the cache elsewhere; the session's cache comes back after each."""
    yield
    compile_cache.use()
    assert jax.config.jax_compilation_cache_dir == os.environ[compile_cache.ENV]


def _losses(out: str) -> list[str]:
    return [line.split()[3] for line in out.splitlines() if line.startswith("step ") and "loss" in line]


def test_a_repeated_run_loads_its_step_from_the_cache(tmp_path, capsys, session_cache, monkeypatch):
    """The second run loads the step whole (never traced nor lowered); a damaged entry is compiled again, said once."""
    cache = tmp_path / "cache"
    assert cli.main([*TRAIN, "--compile-cache", str(cache)]) == 0
    first = capsys.readouterr().out
    assert f"step compiled (compile cache {cache})" in " ".join(first.split())
    stored = list((cache / executables.SUBDIRECTORY).iterdir())
    assert [p.suffix for p in stored] == [".exe"], stored  # the step, whole, and no temporary file left
    with monkeypatch.context() as patch:
        patch.setattr(Step, "lower", lambda *a: pytest.fail("the stored step was traced again"))
        assert cli.main([*TRAIN, "--compile-cache", str(cache)]) == 0
    second = capsys.readouterr().out
    assert f"step loaded from the compile cache {cache}" in " ".join(second.split())
    assert "attention flash" in second  # what tracing told the header, stored with the step
    stored[0].write_bytes(b"not an executable")
    with pytest.warns(UserWarning, match="cannot be loaded"):
        assert cli.main([*TRAIN, "--compile-cache", str(cache)]) == 0
    third = capsys.readouterr().out
    assert _losses(first) and _losses(first) == _losses(second) == _losses(third)
    assert pickle.loads(stored[0].read_bytes())["executable"]  # written again, whole


def test_a_stored_step_is_found_only_by_its_exact_key(tmp_path, monkeypatch):
    """Another program description, other argument shapes, dtypes or shardings, or other jaxpar source: a miss."""
    x = jax.numpy.arange(8.0)
    key = executables.key({"plan": "p", "lr": 0.1}, (x,))
    compiled = jax.jit(lambda v: v * 2 + 1).lower(x).compile()
    assert executables.store(tmp_path, key, compiled, {"used": {"flash"}})
    loaded, extra = executables.load(tmp_path, key, (x,))
    assert extra == {"used": {"flash"}} and (loaded(x) == x * 2 + 1).all()
    others = [executables.key({"plan": "p", "lr": 0.2}, (x,)), executables.key({"plan": "p", "lr": 0.1}, (x[:4],)),
              executables.key({"plan": "p", "lr": 0.1}, (x.astype("int32"),)),
              executables.key({"plan": "p", "lr": 0.1}, (jax.device_put(x, jax.devices()[1]),))]
    monkeypatch.setattr(executables, "source_digest", lambda: "an edited jaxpar")
    others.append(executables.key({"plan": "p", "lr": 0.1}, (x,)))
    assert key not in others and len(set(others)) == len(others)
    assert all(executables.load(tmp_path, other, (x,)) is None for other in others)


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

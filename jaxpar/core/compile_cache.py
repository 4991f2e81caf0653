"""JAX's persistent compilation cache, on by default: a restarted, resumed or repeated run loads its compiled step.

Compiling a training step is most of a run's start-up (tens of seconds on a small host, minutes for a large model
on a GPU cluster), and a job restarted after a lost host, a resumed run, `jaxpar eval` of a checkpoint and every
test that builds the same step again all compile the same program. JAX keeps compiled executables in a directory
keyed by the program, the devices, the compile options and the XLA flags, so a changed plan or model never loads a
stale one.

Where the cache lives, first that applies: `use(setting)` from `--compile-cache DIR|off` or `[train]
compile_cache`; the environment's `JAXPAR_COMPILE_CACHE` (a directory or `off`); a directory already given to JAX
(`JAX_COMPILATION_CACHE_DIR` or `jax.config`); else `$XDG_CACHE_HOME/jaxpar/xla` (`~/.cache/jaxpar/xla`). On a
cluster give every host the same shared path: JAX writes an entry from process 0 only and every process reads it.
`import jaxpar` turns the default on, so one's own training loop gets it too. Compiles for a compile-only target
(`--target`) run with it `suspended()`: no process without that hardware can load such an executable, and JAX would
warn at each later compile of the same step that it cannot read the entry.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import jax

ENV = "JAXPAR_COMPILE_CACHE"
OFF = "off"
# Programs that compile faster than this are not written: the many small helper programs of a run (a broadcast,
# a random key) would cost a file each and save little. A training step compiles for seconds.
MIN_COMPILE_SECONDS = 0.5
_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def default_directory(environ=os.environ) -> Path:
    """The user's cache directory for compiled programs (XDG's cache home)."""
    home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "jaxpar" / "xla"


def resolve(setting: str | None = None, environ=os.environ) -> Path | None:
    """The cache directory a setting names (None: off), by the precedence in the module's docstring."""
    for choice in (setting, environ.get(ENV) or None):
        if choice is not None:
            return None if str(choice).strip().lower() == OFF else Path(choice).expanduser()
    given = jax.config.jax_compilation_cache_dir
    return Path(given) if given else default_directory(environ)


def use(setting: str | None = None, environ=os.environ) -> Path | None:
    """Point JAX's persistent cache at `resolve(setting)` (or turn it off); return the directory or None.

    Safe to call again with another setting before or after compiles: JAX re-reads its cache on the next compile.
    A directory that cannot be made is one ValueError naming it, before anything compiles.
    """
    from jax.experimental.compilation_cache import compilation_cache

    directory = resolve(setting, environ)
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--compile-cache {directory}: cannot make the directory ({error.strerror}); give a "
                             f"writable directory, or 'off'") from None
    jax.config.update("jax_compilation_cache_dir", None if directory is None else str(directory))
    jax.config.update("jax_enable_compilation_cache", directory is not None)  # off: no key, no lookup either
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:  # a threshold of the user's own stays
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    compilation_cache.reset_cache()  # JAX decides whether it uses a cache once, at its first compile
    _counts.listen()
    return directory


def use_default() -> Path | None:
    """`use()` at `import jaxpar`: the default cache, or none with a warning where its directory cannot be made
    (a read-only home must not stop the import)."""
    try:
        return use()
    except ValueError as error:
        import warnings

        warnings.warn(f"jaxpar: compiled steps are not cached: {error}", stacklevel=2)
        return use(OFF)


@contextlib.contextmanager
def suspended():
    """No persistent cache inside (neither read nor written); the one in use before, after."""
    before = directory()
    use(OFF)
    try:
        yield
    finally:
        use(OFF if before is None else str(before))


def directory() -> Path | None:
    """The cache directory in use now (None: off)."""
    given = jax.config.jax_compilation_cache_dir
    return Path(given) if given else None


def loaded_whole() -> None:
    """Count a step loaded whole from the cache (core/executables.py) as a hit, for `Watch`."""
    _counts.listen()
    _counts._event(_HIT)
    _counts.whole += 1


class _Counts:
    """Persistent-cache hits and misses of this process, from JAX's monitoring events."""

    def __init__(self):
        self.hits = self.misses = self.whole = 0  # whole: steps loaded by core/executables.py
        self._lock = threading.Lock()
        self._listening = False

    def listen(self) -> None:
        with self._lock:
            if not self._listening:
                jax.monitoring.register_event_listener(self._event)
                self._listening = True

    def _event(self, event: str, **_) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1


_counts = _Counts()


class Watch:
    """What the compiles since it was made did: all loaded from the cache, or compiled.

    `watch = Watch(); step(...); watch.source()`: "loaded from the compile cache DIR", "compiled (compile cache
    DIR)", "compiled (the compile cache is off)", or None when nothing compiled in between.
    """

    def __init__(self):
        self.hits, self.misses, self.whole = _counts.hits, _counts.misses, _counts.whole

    def source(self) -> str | None:
        directory = jax.config.jax_compilation_cache_dir
        hits, misses = _counts.hits - self.hits, _counts.misses - self.misses
        if not directory:
            return "compiled (the compile cache is off)"
        # the step loaded whole decides, whatever small helper program beside it missed (one that compiled
        # faster than the cache's threshold the first time was never written)
        if misses and _counts.whole == self.whole:
            return f"compiled (compile cache {directory})"
        return f"loaded from the compile cache {directory}" if hits else None

"""The composition matrix: combinations of plan options, each trained and checked against tests/reference.py.

A cell is a mesh, a model (dense Llama or MoE) and one value of every plan
option: ZeRO stage, tensor form, sequence parallelism, pipeline schedule, grad
accumulation, remat and precision. Options that cannot act on a mesh (tensor
form and sequence parallelism without `tensor`, the schedule without `pipe`)
are left out of its cells (None), so the matrix holds each distinct cell once.
A cell must either train and match the independent reference (fp32: loss of
every step and final parameters within 1e-5 relative), or be refused before
compiling with a ValueError raised by jaxpar itself.

`covering(cells, strength)` picks a subset in which every pair (or t-tuple) of
option values that occurs in the matrix meets at least once (greedy). Cells run
in a worker process (`python tests/matrix.py --serve`), one after another, so
that an XLA abort or a hang fails its cell rather than the whole run; the worker
is restarted after one. tests/test_combinations.py and benchmarks/combinations.py
both use this module.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

MESHES = (
    "data=8",
    "data=4,tensor=2",
    "data=4,pipe=2",
    "data=2,tensor=2,pipe=2",
    "data=2,expert=2,tensor=2",
    "data=2,pipe=2,expert=2",
)
OPTIONS: dict[str, tuple] = {
    "mesh": MESHES,
    "model": ("dense", "moe"),
    "zero": (0, 1, 2, 3),
    "tensor_form": ("annotation", "explicit"),
    "sequence_parallel": (False, True),
    "schedule": ("gpipe", "1f1b", "interleaved", "zb-h1"),
    "grad_accum": (1, 2),
    "remat": ("none", "full", "selective"),
    "precision": ("fp32", "bf16", "fp16", "bf16-params"),
}
DIMS = tuple(OPTIONS)

STEPS = 3
BATCH, SEQ, VOCAB = 16, 16, 250  # vocab 250 is padded to 256 rows: the padded columns are masked from the loss
MODELS = {
    "dense": dict(vocab=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=SEQ),
    "moe": dict(vocab=VOCAB, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, seq_len=SEQ,
                moe_every=2, n_experts=8, top_k=2, expert_d_ff=32, capacity_factor=1.25, router_z_coef=1e-3),
}
LEARNING_RATE = 1e-3
# (loss, gradient norm and parameters) relative tolerance per precision. fp32 is the contract. At 16 bits the
# sharded run and the reference round differently (other summation orders, gradients reduced in 16 bits), and
# Adam's first steps move every weight by about the learning rate whatever its gradient's size, so a weight
# whose 16-bit gradient is at roundoff level can step the other way: those cells get the slack of their format.
# The gradient norm is compared because Adam and clipping would hide a gradient off by a constant factor.
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (5e-3, 2e-2), "fp16": (1e-3, 5e-3), "bf16-params": (5e-3, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Cell:
    mesh: str
    model: str = "dense"
    zero: int = 0
    tensor_form: str | None = None
    sequence_parallel: bool | None = None
    schedule: str | None = None
    grad_accum: int = 1
    remat: str = "none"
    precision: str = "fp32"

    @property
    def shape(self) -> dict[str, int]:
        return {k: int(v) for k, v in (part.split("=") for part in self.mesh.split(","))}

    @property
    def id(self) -> str:
        parts = [self.mesh, self.model, f"zero{self.zero}"]
        if self.tensor_form is not None:
            parts += [self.tensor_form, "sp" if self.sequence_parallel else "nosp"]
        if self.schedule is not None:
            parts.append(self.schedule)
        parts += [f"accum{self.grad_accum}", f"remat-{self.remat}", self.precision]
        return "/".join(parts)

    def __str__(self) -> str:
        return self.id

    def plan_options(self) -> dict:
        """The keyword arguments of `Plan.create` for this cell."""
        options = dict(zero=self.zero, grad_accum=self.grad_accum, remat=self.remat, precision=self.precision)
        if self.tensor_form is not None:
            options.update(tensor_form=self.tensor_form, sequence_parallel=self.sequence_parallel)
        if self.schedule is not None:
            options["schedule"] = self.schedule
            if self.schedule == "interleaved":
                options["virtual_stages"] = 2
        return options

    def values(self) -> dict:
        return {d: getattr(self, d) for d in DIMS}


def applies(dim: str, mesh: str) -> bool:
    """Whether option `dim` can act on `mesh` (others are left out of its cells)."""
    shape = Cell(mesh).shape
    if dim in ("tensor_form", "sequence_parallel"):
        return shape.get("tensor", 1) > 1
    if dim == "schedule":
        return shape.get("pipe", 1) > 1
    return True


def full_matrix() -> list[Cell]:
    """Every distinct cell: the product of all option values that apply to each mesh."""
    cells = []
    for mesh in MESHES:
        ranges = [OPTIONS[d] if applies(d, mesh) else (None,) for d in DIMS[1:]]
        cells.extend(Cell(mesh, *values) for values in itertools.product(*ranges))
    return cells


def covering(cells: list[Cell], strength: int = 2) -> list[Cell]:
    """A subset of `cells` in which every `strength`-tuple of option values found in `cells` occurs (greedy).

    Tuples are covered by cells that must train wherever they can be; cells of a
    known refusal (`expected_refusal`) only cover the tuples no trainable cell
    holds, so a refused cell never stands in for a combination that has to run.
    Each round takes the cell that covers the most tuples not yet covered (the
    first such in `cells`' order), so the result is deterministic.
    """
    runnable = [c for c in cells if expected_refusal(c) is None]
    refused = [c for c in cells if expected_refusal(c) is not None]
    index: dict[tuple, int] = {}
    tables = [_tuple_table(group, strength, index) for group in (runnable, refused)]
    uncovered = np.ones(len(index) + 1, dtype=bool)
    uncovered[-1] = False  # the padding tuple
    chosen = []
    for group, table in zip((runnable, refused), tables):
        table = np.where(table < 0, len(index), table)
        while group and uncovered[table].any():
            best = int(np.argmax(uncovered[table].sum(axis=1)))
            chosen.append(group[best])
            uncovered[table[best]] = False
    return chosen


def _tuple_table(cells: list[Cell], strength: int, index: dict) -> np.ndarray:
    """[cells, tuples per cell] ids of each cell's `strength`-tuples of option values (-1: padding)."""
    rows = []
    for cell in cells:
        present = [(d, v) for d, v in cell.values().items() if v is not None]
        rows.append([index.setdefault(t, len(index)) for t in itertools.combinations(present, strength)])
    table = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


# The fast suite's meshes: every axis > 1 somewhere, each mesh with two or three of them. data=8 and
# data=4,pipe=2 stay in the full matrix; their strategies meet here on the 3-axis meshes (and test_zero,
# test_pipeline run them on their own).
FAST_MESHES = ("data=4,tensor=2", "data=2,tensor=2,pipe=2", "data=2,expert=2,tensor=2", "data=2,pipe=2,expert=2")


def fast_cells() -> list[Cell]:
    """The pairwise covering subset the fast suite runs: every pair of option values on the fast meshes."""
    return covering([c for c in full_matrix() if c.mesh in FAST_MESHES], 2)


def uncovered_pairs(subset: list[Cell], cells: list[Cell]) -> set:
    """Pairs of option values found in `cells` that no cell of `subset` holds (empty for a covering)."""
    def pairs(cell):
        present = [(d, v) for d, v in cell.values().items() if v is not None]
        return set(itertools.combinations(present, 2))

    return set().union(*map(pairs, cells)) - set().union(*map(pairs, subset))


# Refusals the matrix knows of: (what the cell has, a phrase of jaxpar's message). A refusal outside this
# list is a new limitation that needs a decision, and fails the test.
KNOWN_REFUSALS = (
    # The MoE model's 4 layers are 2 groups (dense + MoE), too few for pipe=2 x 2 virtual stages.
    (lambda c: c.model == "moe" and c.schedule == "interleaved", "do not divide into pipe=2 x virtual_stages=2"),
    (lambda c: c.model == "moe" and c.tensor_form == "explicit" and c.shape.get("tensor", 1) > 1,
     "tensor_form='annotation'"),
    (lambda c: c.tensor_form == "explicit" and c.precision != "fp32" and c.shape.get("expert", 1) > 1, "XLA:CPU"),
)


def expected_refusal(cell: Cell) -> str | None:
    """The phrase a known refusal of `cell` mentions, or None if the cell must train."""
    return next((phrase for applies_to, phrase in KNOWN_REFUSALS if applies_to(cell)), None)


# -- one cell, in this process ----------------------------------------------------------------

_cache: dict = {}


def _setup(model_name: str, precision: str):
    """(model config, model definition, initial state at `precision` on host, fp32 initial parameters, batches)."""
    key = ("setup", model_name, precision)
    if key in _cache:
        return _cache[key]
    import jax
    from flax import nnx

    from jaxpar.data.tokens import Batches, default_corpus
    from jaxpar.models.llama import Llama, LlamaConfig
    from jaxpar.models.moe import MoeLlama, MoeLlamaConfig
    from jaxpar.core.plan import Plan
    from jaxpar.train.state import init_state

    config = (MoeLlamaConfig if model_name == "moe" else LlamaConfig)(**MODELS[model_name])
    make = (lambda: MoeLlama(config, nnx.Rngs(0))) if model_name == "moe" else (lambda: Llama(config, nnx.Rngs(0)))
    one_device = jax.devices()[:1]
    model, state32 = init_state(make, optimizer(), Plan.create("data=1", devices=one_device))
    _, state = init_state(make, optimizer(), Plan.create("data=1", devices=one_device, precision=precision))
    data = Batches(default_corpus() % VOCAB, BATCH, SEQ, seed=0)
    batches = [data[i] for i in range(STEPS)]
    _cache[key] = (config, model, jax.device_get(state), jax.device_get(state32.params), batches)
    return _cache[key]


def _expected(model_name: str, precision: str):
    """The reference's Result for the model at `precision` (computed once, when a cell has trained)."""
    import reference

    key = ("expected", model_name, precision)
    if key not in _cache:
        config, _, _, params0, batches = _setup(model_name, precision)
        _cache[key] = reference.train(reference.loss_fn(config), params0, batches, optimizer(), precision)
    return _cache[key]


def optimizer():
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LEARNING_RATE, weight_decay=0.1))


def _raised_by_jaxpar(error: BaseException) -> bool:
    """Whether the innermost frame of `error` is jaxpar's or its models' own code (a deliberate check)."""
    import jaxpar
    import jaxpar.models

    frames = traceback.extract_tb(error.__traceback__)
    roots = (os.path.dirname(jaxpar.__file__), os.path.dirname(jaxpar.models.__file__))
    return bool(frames) and any(os.path.abspath(frames[-1].filename).startswith(r + os.sep) for r in roots)


def _message(error: BaseException, head: int = 4, tail: int = 8, width: int = 400) -> str:
    """The error's type and message: its first and last lines (a long repr in between is cut), each line cut too."""
    lines = [line for line in f"{type(error).__name__}: {error}".strip().splitlines() if line.strip()]
    if len(lines) > head + tail:
        lines = [*lines[:head], f"... ({len(lines) - head - tail} lines) ...", *lines[-tail:]]
    return "\n".join(line if len(line) <= width else line[:width] + " ..." for line in lines)


def _relative(values: np.ndarray, expected: np.ndarray) -> float:
    """Largest relative error of `values`; steps both skipped (non-finite, e.g. an fp16 overflow) agree."""
    both = ~np.isfinite(values) & ~np.isfinite(expected)
    errors = np.abs(values - expected) / np.abs(expected)
    return float(np.max(np.where(both, 0.0, errors)))


def run_cell(cell: Cell) -> dict:
    """Train `cell` for STEPS steps and compare it with the reference: one row of the table."""
    import jax
    import numpy as np

    from helpers import max_relative_error
    from jaxpar.pipeline import executor as pipeline
    from jaxpar.pipeline.layer_order import to_natural_order
    from jaxpar.core.plan import Plan
    from jaxpar.train.state import place_state
    from jaxpar.train.step import make_train_step

    row = {"cell": cell.id, **cell.values(), "status": None, "error": None, "stage": None,
           "loss_error": None, "grad_norm_error": None, "param_error": None, "seconds": None}
    start = time.perf_counter()
    stage = "setup"
    try:
        _, model, state, _, batches = _setup(cell.model, cell.precision)
        devices = jax.devices()[: math.prod(cell.shape.values())]
        try:
            stage = "plan"
            plan = Plan.create(cell.mesh, devices=devices, **cell.plan_options())
            stage = "place"
            state = place_state(state, model, optimizer(), plan)
            stage = "trace"
            step = make_train_step(model, lambda m, b: m(b), optimizer(), plan)
            with pipeline.bubble_fill(float("nan")):
                lowered = step.lower(state, batches[0])
        except ValueError as error:
            if not _raised_by_jaxpar(error):
                raise
            row.update(status="refused", error=_message(error), stage=stage)
            return row
        stage = "compile"
        compiled = lowered.compile()
        stage = "run"
        losses, norms = [], []
        for batch in batches:
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        params = to_natural_order(jax.device_get(state.params), model.logical, plan)
        stage = "reference"
        expected = _expected(cell.model, cell.precision)
        stage = "compare"
        f32 = lambda tree: jax.tree.map(lambda a: np.asarray(a, np.float32), tree)  # noqa: E731
        losses, norms = np.array(losses), np.array(norms)
        loss_error = float(np.max(np.abs(losses - expected.losses) / np.abs(expected.losses)))
        norm_error = _relative(norms, expected.grad_norms)
        param_error = max_relative_error(f32(params), f32(expected.params))
        if expected.master is not None:
            param_error = max(param_error, max_relative_error(f32(params), expected.master))
        row.update(loss_error=loss_error, grad_norm_error=norm_error, param_error=param_error)
        loss_tol, param_tol = TOLERANCE[cell.precision]
        if not (loss_error <= loss_tol and norm_error <= param_tol and param_error <= param_tol):  # catches NaN
            row.update(status="failed", error=(
                f"does not match the reference: loss error {loss_error:.3g} (tolerance {loss_tol:g}), gradient norm "
                f"error {norm_error:.3g} and parameter error {param_error:.3g} (tolerance {param_tol:g}); losses "
                f"{losses.tolist()} vs {expected.losses.tolist()}, gradient norms {norms.tolist()} vs "
                f"{expected.grad_norms.tolist()}"))
        else:
            row.update(status="ok")
    except Exception as error:  # noqa: BLE001 - a cell's failure is data for the table
        row.update(status="failed", error=_message(error))
    finally:
        row["stage"] = row["stage"] or stage
        row["seconds"] = round(time.perf_counter() - start, 2)
    return row


# -- cells in a worker process ----------------------------------------------------------------

_PREFIX = "@@matrix-row "


def serve() -> None:
    """Worker loop: read one cell (JSON) per line on stdin, print its row on stdout."""
    import jax

    jax.config.update("jax_traceback_filtering", "off")
    for line in sys.stdin:
        if line.strip():
            row = run_cell(Cell(**json.loads(line)))
            print(_PREFIX + json.dumps(row), flush=True)


def worker_env() -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["JAX_TRACEBACK_FILTERING"] = "off"
    return env


class Worker:
    """Runs cells one at a time in a child process; a crash or a timeout fails that cell and restarts it."""

    def __init__(self, timeout: float = 600.0):
        self.timeout = timeout
        self.process = None
        self.stderr = None

    def _start(self):
        self.stderr = open(_stderr_path(), "w+")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=worker_env(),
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()

    @staticmethod
    def _read(process, lines):
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    def run(self, cell: Cell) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.close()
            self._start()
        start = time.perf_counter()
        self.process.stdin.write(json.dumps(dataclasses.asdict(cell)) + "\n")
        self.process.stdin.flush()
        deadline = start + self.timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                return self._lost(cell, f"timed out after {self.timeout:.0f} s", start)
            if line is None:
                code = self.process.wait()
                return self._lost(cell, f"worker process died (exit code {code})", start)
            if line.startswith(_PREFIX):
                return json.loads(line[len(_PREFIX):])

    def _lost(self, cell: Cell, why: str, start: float) -> dict:
        """The row of a cell whose worker crashed or hung: the last lines it wrote to stderr say why."""
        self._stop()
        self.stderr.seek(0)
        tail = [line.rstrip() for line in self.stderr.read().splitlines() if line.strip()][-8:]
        self.close()
        return {"cell": cell.id, **cell.values(), "status": "failed", "error": "\n".join([why, *tail])[:3000],
                "stage": "worker", "loss_error": None, "grad_norm_error": None, "param_error": None,
                "seconds": round(time.perf_counter() - start, 2)}

    def _stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self):
        self._stop()
        if self.stderr is not None:
            self.stderr.close()
            os.unlink(self.stderr.name)
            self.stderr = None


def _stderr_path() -> str:
    import tempfile

    handle, path = tempfile.mkstemp(prefix="jaxpar-matrix-", suffix=".stderr")
    os.close(handle)
    return path


def summary(rows: list[dict]) -> dict:
    """Counts per status and the worst errors against the reference, overall and in fp32."""
    out = {status: sum(r["status"] == status for r in rows) for status in ("ok", "refused", "failed")}
    for name, subset in (("", rows), ("fp32_", [r for r in rows if r["precision"] == "fp32"])):
        for key in ("loss_error", "grad_norm_error", "param_error"):
            values = [r[key] for r in subset if r[key] is not None]
            out[f"worst_{name}{key}"] = max(values) if values else None
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        serve()

"""The walk of a run's data through `jaxpar.run.training.prepare`: which data modules it passes, and how often it
climbs back up a layer (issue 46's measure of a data path that goes down, not back and forth).

The walk is traced, not guessed: every call into a jaxpar module of the data path while `prepare` runs, in order,
repeats of one module in a row folded into one. A climb is a step of the walk from one module into another of a higher
layer (layers as tests/test_import_graph.py orders them), counted once per pair of modules however many records
repeat it. `python tests/data_walk.py` prints the walks of a token file, of
packed JSON lines documents and of a mixture.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_import_graph import LAYERS, layer  # noqa: E402

# Where a run's data is read, before and after jaxpar/data/ gathered it: the data layer, the old homes of its
# modules, and the run that reads it.
DATA_PREFIXES = ("jaxpar.data.", "jaxpar.run.training", "jaxpar.run.evaluate", "jaxpar.run.packed",
                 "jaxpar.run.holdout", "jaxpar.interop.tokenize", "jaxpar.interop.records")
OLD_TRAIN = ("sources", "record_index", "block_packing", "shared_counts", "packing", "epochs", "mixture",
             "packed_mixture", "prefetch", "data")


def on_the_path(module: str) -> bool:
    return module.startswith(DATA_PREFIXES) or module in {f"jaxpar.train.{name}" for name in OLD_TRAIN}


def walk(config, plan) -> list[str]:
    """The data modules `prepare(config, plan)` calls into, in order, consecutive repeats folded."""
    from jaxpar.run.training import prepare

    seen: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if on_the_path(module) and (not seen or seen[-1] != module):
            seen.append(module)

    gc.collect()  # an earlier test's abandoned batch stream, finalized mid-walk, would enter its modules out of turn
    gc.disable()
    sys.setprofile(profile)
    try:
        prepare(config, plan)
    finally:
        sys.setprofile(None)
        gc.enable()
    return seen


def climbs(path: list[str]) -> list[tuple[str, str]]:
    """The distinct steps (from, to) of `path` into a higher layer, in the order first taken."""
    rank = {m: LAYERS.index(layer(m)) for m in path}
    steps = [(a, b) for a, b in zip(path, path[1:]) if rank[b] > rank[a]]
    return list(dict.fromkeys(steps))


def examples(folder: Path) -> dict:
    """Three runs' configs (token file, packed JSON lines documents, a mixture of both) with files in `folder`."""
    import json

    import numpy as np

    from jaxpar.run.training import TrainConfig

    tokens = folder / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16))
    documents = folder / "docs.jsonl"
    documents.write_text("".join(json.dumps({"text": f"document {i} " * (3 + i % 7)}) + "\n" for i in range(40)))
    base = dict(model="tiny", batch_size=8, seq_len=16, steps=2)
    return {"token file": TrainConfig(data=str(tokens), **base),
            "documents": TrainConfig(data=str(documents), **base),
            "mixture": TrainConfig(data=f"{documents}:0.7,{tokens}:0.3", **base)}


if __name__ == "__main__":
    import tempfile

    import conftest  # noqa: F401  (the 8 forced CPU devices)
    from jaxpar.core.plan import Plan

    with tempfile.TemporaryDirectory() as tmp:
        for name, config in examples(Path(tmp)).items():
            walk(config, Plan.create("data=8"))  # once to import what it imports: the second walk is the path alone
            path = walk(config, Plan.create("data=8"))
            up = climbs(path)
            print(f"{name}: modules {list(dict.fromkeys(path))}\n  {len(up)} climbs: "
                  + ", ".join(f"{a} -> {b}" for a, b in up))

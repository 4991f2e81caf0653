"""The composition matrix as JSON: one row per cell with its status (ok / refused / failed), error and
the largest loss and parameter errors against the independent reference (tests/reference.py).

    python benchmarks/combinations.py [--cells full|pairwise|3-wise] [--filter TEXT ...] [--limit N]
                                      [--timeout SECONDS] [--out FILE]

Cells run one after another in a worker process (tests/matrix.py), so an XLA abort or a hang fails
only its cell. With --out the table so far is rewritten after every cell, for reading partial results
of a long run; stdout gets the whole table and the counts at the end.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import matrix  # noqa: E402


def select(args) -> list:
    cells = matrix.full_matrix()
    if args.cells != "full":
        cells = matrix.covering(cells, {"pairwise": 2, "3-wise": 3}[args.cells])
    if args.filter:
        cells = [c for c in cells if any(matches(c, text) for text in args.filter)]
    return cells[: args.limit] if args.limit else cells


def matches(cell, text: str) -> bool:
    """Every /-separated part of `text` is a part of the cell's id or a piece of its mesh."""
    return all(part in cell.id.split("/") or part in cell.mesh for part in text.split("/"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", choices=("full", "pairwise", "3-wise"), default="full")
    parser.add_argument("--filter", action="append", default=[],
                        help="keep cells whose id holds every /-separated part, e.g. 'zero3/explicit' (repeated: any of them)")
    parser.add_argument("--limit", type=int, default=0, help="run at most this many cells")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one cell may take")
    parser.add_argument("--out", help="rewrite the table so far to this JSON file after every cell")
    args = parser.parse_args()

    cells = select(args)
    worker = matrix.Worker(timeout=args.timeout)
    rows, start = [], time.perf_counter()
    try:
        for i, cell in enumerate(cells):
            row = worker.run(cell)
            rows.append(row)
            first = (row["error"] or "").splitlines()[:1]
            print(f"[{i + 1}/{len(cells)}] {row['status']:8} {row['seconds']:7.1f}s {cell} {' '.join(first)}",
                  file=sys.stderr, flush=True)
            if args.out:
                write(args.out, table(args, rows, len(cells), start))
    finally:
        worker.close()
    result = table(args, rows, len(cells), start)
    if args.out:
        write(args.out, result)
    print(json.dumps(result, indent=1))


def table(args, rows, total, start) -> dict:
    return {"cells": args.cells, "filter": args.filter, "planned": total, "done": len(rows),
            "seconds": round(time.perf_counter() - start, 1), "python": sys.version.split()[0],
            "jax": _jax_version(), "summary": matrix.summary(rows), "rows": rows}


def _jax_version() -> str:
    from importlib.metadata import version

    return version("jax")


def write(path: str, result: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(target)


if __name__ == "__main__":
    main()

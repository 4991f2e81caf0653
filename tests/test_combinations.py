"""Every combination of plan options trains like the independent single-device reference, or is refused.

The fast suite runs a pairwise covering subset of the matrix (tests/matrix.py) on
its four fast meshes: every pair of option values that can occur together there
meets in at least one cell.
The whole matrix is marked slow (`pytest -m slow tests/test_combinations.py`,
narrowed with `-k`). A cell passes if it matches tests/reference.py (fp32: loss
of every step and final parameters within 1e-5 relative) or if jaxpar refuses it
before compiling with one of the matrix's known refusals.
"""

import pytest

import matrix

FAST = matrix.fast_cells()


@pytest.fixture(scope="module")
def worker():
    w = matrix.Worker(timeout=900)
    yield w
    w.close()


def check(row: dict, cell: matrix.Cell) -> None:
    if row["status"] == "refused":
        phrase = matrix.expected_refusal(cell)
        assert phrase is not None, f"{cell} refused, but it must train: {row['error']}"
        assert phrase in row["error"], f"{cell} refused without naming {phrase!r}: {row['error']}"
        return
    assert row["status"] == "ok", f"{cell} failed at {row['stage']}: {row['error']}"


@pytest.mark.parametrize("cell", FAST, ids=str)
def test_pairwise_cell(cell, worker):
    check(worker.run(cell), cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", matrix.full_matrix(), ids=str)
def test_full_matrix_cell(cell, worker):
    check(worker.run(cell), cell)


def test_fast_cells_meet_every_pair_of_option_values():
    assert not matrix.uncovered_pairs(FAST, [c for c in matrix.full_matrix() if c.mesh in matrix.FAST_MESHES])
    assert {c.mesh for c in FAST} == set(matrix.FAST_MESHES)

"""Where ZeRO puts each array's shard: the dimension it splits over the ZeRO axes, and what must stay whole.

These are spec rules, read by the Plan when it turns logical names into
PartitionSpecs (ZeRO-1 for the optimizer state, ZeRO-2/3 for the parameters
too); the collectives that move between the shards and the whole arrays are
`jaxpar.parallel.zero`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.core import rules as rules_lib

AXES = ("replica", "data")  # the batch axes ZeRO may shard over; the step runs its gradients per rank of these
SCANNED = "layers"  # the stacked-layers dimension: a layer scan slices it, so ZeRO never shards it
# a stack of layers no pipeline cuts (they run with the embedding: DeepSeek-V3's dense first blocks), scanned alike
PREFIX_SCANNED = "prefix_layers"


def axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entries_of(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def zero_axes_of(entry) -> tuple[str, ...]:
    """The ZeRO axes (`AXES`) one spec entry names."""
    return tuple(a for a in axes_of(entry) if a in AXES)


def over_zero_axes(entries) -> bool:
    return any(zero_axes_of(e) for e in entries)


def dim_over_zero_axes(entries) -> int | None:
    return next((d for d, e in enumerate(entries) if zero_axes_of(e)), None)


def choose_dim(names: Sequence[str | None], shape: Sequence[int], spec: P, data: int) -> int | None:
    """The dimension of one array that ZeRO shards over its `data` ranks (the product of the ZeRO axes; None: whole).

    The first (most major) dimension that no mesh axis shards yet, that is
    not the stacked `layers` axis, and whose size divides by `data`. Gathered
    along its major dimension, an array comes back as contiguous blocks in its
    own layout; gathered along a minor one it needs a relayout. On issue 16's
    fsdp8 the output layer gathered along its vocabulary (the largest
    dimension, chosen before) cost a transposing copy and converts, 2982 ms of
    op self time per device-step against 2695 ms (jax.profiler, XLA:CPU).
    """
    entries = entries_of(spec, len(shape))
    if data == 1 or over_zero_axes(entries):
        return None
    free = [d for d, e in enumerate(entries) if e is None and names[d] not in (SCANNED, PREFIX_SCANNED)
            and shape[d] % data == 0]
    return free[0] if free else None


def add_data_axis(spec: P, leaf, plan) -> P:
    """`spec` with the plan's ZeRO axes (`Plan.zero_axes`) added on the dimension `choose_dim` picks for `leaf`."""
    axes = plan.zero_axes
    dim = choose_dim(leaf.names, leaf.shape, spec, plan.zero_ranks)
    if dim is None:
        return spec
    entries = list(entries_of(spec, len(leaf.shape)))
    entries[dim] = axes[0] if len(axes) == 1 else axes
    while entries[-1] is None:
        entries.pop()
    return P(*entries)


@dataclasses.dataclass(frozen=True)
class ReplicatedReport:
    """Parameters that ZeRO leaves whole on every data rank, and their share of all parameter bytes.

    `data` is the number of ranks ZeRO shards over, `over` how the ZeRO axes
    read (`data=4`, `replica=2 x data=4 = 8`).
    """

    data: int
    over: str
    replicated: tuple[tuple[str, tuple[int, ...], int], ...]  # (path, shape, bytes)
    total_bytes: int

    @property
    def replicated_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.replicated)

    @property
    def fraction(self) -> float:
        return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0

    def __str__(self) -> str:
        head = (
            f"ZeRO over {self.over}: {len(self.replicated)} parameters stay replicated, "
            f"{self.replicated_bytes} of {self.total_bytes} bytes ({self.fraction:.2%})"
        )
        rows = [f"  {path} {shape}: no unsharded dimension divides by {self.over}"
                for path, shape, _ in self.replicated]
        return "\n".join([head, *rows])


def replicated_report(logical, plan) -> ReplicatedReport:
    """Which parameters of a model (a tree of LogicalArray) ZeRO cannot shard under `plan`."""
    data = plan.zero_ranks
    replicated, total = [], 0
    leaves = jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: hasattr(x, "names"))[0]
    for path, leaf in leaves:
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        total += nbytes
        name = jax.tree_util.keystr(path)
        spec = rules_lib.resolve_spec(leaf.names, leaf.shape, plan.shape, plan.rules, path=name)
        if data > 1 and choose_dim(leaf.names, leaf.shape, spec, data) is None:
            replicated.append((name, tuple(leaf.shape), nbytes))
    over = " x ".join(f"{a}={plan.shape[a]}" for a in plan.zero_axes) + ("" if len(plan.zero_axes) == 1 else f" = {data}")
    return ReplicatedReport(data, over, tuple(replicated), total)


def check_replicated(report: ReplicatedReport, tolerance: float) -> None:
    """Raise when more than `tolerance` of the parameter bytes would stay replicated."""
    if report.fraction > tolerance:
        raise ValueError(
            f"{report}\nthat is above zero_tolerance={tolerance:.2%}: pick ZeRO axis sizes ({report.over}) that divide these "
            f"dimensions, or raise zero_tolerance"
        )


def no_effect_message(plan) -> str | None:
    """Why `plan.zero` changes nothing (its ZeRO axes have size 1), or None when it does shard something."""
    if plan.zero and plan.zero_ranks == 1:
        return (
            f"zero={plan.zero} has no effect: the {' and '.join(plan.zero_axes)} "
            f"{'axis has' if len(plan.zero_axes) == 1 else 'axes have'} size 1, so parameters, gradients and "
            f"optimizer state stay whole on every device"
        )
    return None


def table_gather_is_cheaper(vocab: int, d_model: int, data: int, rows_per_rank: int, width: int,
                            token_width: int = 4) -> bool:
    """Whether a ZeRO-2/3 embedding lookup should gather its table rather than look up in each rank's rows.

    Gathering moves the table and reduce-scatters its whole gradient; looking up
    in the shards all-gathers the data group's tokens, reduce-scatters the
    looked-up rows and all-gathers their cotangents. Both sides move (n-1)/n of
    their buffers, so the factor cancels. Decided per lookup run: under
    accumulation the table's gradient is reduce-scattered once per run too, so
    the rule only picks the gather where it is cheaper in total.
    """
    table = 2 * vocab * d_model * width
    lookup = data * rows_per_rank * (token_width + 2 * d_model * width)
    return table < lookup

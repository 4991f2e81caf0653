"""What a compiled step really does: its collectives, memory and FLOPs, read back from XLA.

Collectives come from the optimized HLO text: each op's kind, the mesh axes its
replica groups span, its buffer sizes, and how many times it runs (ops inside
`while` loops, i.e. scans, are multiplied by the loop's known trip count).
`bytes` is the size of the whole buffer a call reduces or gathers; `traffic` is
what one device sends under a bandwidth-optimal ring algorithm. A pipelined
plan adds its schedule's figures: bubble, live microbatches and the bytes of
the residual ring its tick loops carry (`pipeline_figures`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLEE = re.compile(r"\b(body|calls|to_apply|branch_computations|true_computation|false_computation)=\{?%?([\w.\-, %]+)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(r"\bdot\(%?([\w.\-]+),\s*%?[\w.\-]+\).*lhs_contracting_dims=\{([0-9,]*)\}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled module."""

    kind: str
    axes: tuple[str, ...]
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    bytes: int  # per call: the whole buffer reduced / gathered (see module docstring)
    group_size: int
    count: int  # executions per step (trip counts of enclosing loops multiplied in)
    computation: str
    name: str

    @property
    def traffic(self) -> float:
        return ring_traffic(self.kind, self.bytes, self.group_size)


def ring_traffic(kind: str, nbytes: float, n: int) -> float:
    """Bytes one device sends for a collective over n devices with a bandwidth-optimal ring."""
    if kind == "collective-permute":
        return float(nbytes)
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return factor * nbytes


def _hlo_text(compiled) -> str:
    return compiled if isinstance(compiled, str) else compiled.as_text()


def _split_computations(text: str) -> dict[str, list[str]]:
    computations, current, entry = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            computations[current].append(line)
    computations["__entry__"] = [entry] if entry else []
    return computations


def _execution_counts(computations: dict[str, list[str]]) -> dict[str, int]:
    """How many times each computation runs per step, following calls and while loops.

    Every branch of a conditional counts as running (an upper bound), except
    that of the pipeline's conditionals of one slot kind at its places in a
    tick (`jaxpar.pipeline.tick.PLACE_SCOPE`) only the first counts: a stage runs
    the slot at one of them (per tick: a double-buffered loop body holds two).
    """
    from jaxpar.pipeline.tick import PLACE_SCOPE

    place = re.compile(r'op_name="[^"]*/' + PLACE_SCOPE.format(kind=r"(\w+)") + '/cond"')
    entry = computations["__entry__"][0]
    counts: dict[str, int] = collections.defaultdict(int)

    def visit(name: str, times: int) -> None:
        counts[name] += times
        placed = set()
        for line in computations.get(name, []):
            slot = place.search(line) if " conditional(" in line else None
            # XLA:GPU's double buffering unrolls a loop body twice: the copy's tick has its own places
            key = slot and (slot.group(1), line.split("=")[0].count("double_buffer_clone"))
            if slot and key in placed:
                continue
            if slot:
                placed.add(key)
            trip = _TRIP.search(line)
            for role, callees in _CALLEE.findall(line):
                multiplier = int(trip.group(1)) if (role == "body" and trip) else 1
                for callee in re.split(r"[,\s]+", callees):
                    callee = callee.lstrip("%")
                    if callee in computations and callee != name:
                        visit(callee, times * multiplier)

    visit(entry, 1)
    return counts


def _iota_ids(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _parse_groups(line: str) -> list[tuple[int, ...]] | None:
    """Replica groups of an instruction in any of XLA's three text forms."""
    mesh_form = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", line)
    if mesh_form:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh_form.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        if mesh_form.group(2):
            perm = [int(p) for p in mesh_form.group(3).split(",")] if mesh_form.group(3) else None
            ids = _iota_ids([int(d) for d in mesh_form.group(2).split(",")], perm).reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        reduced = [names.index(a) for a in re.findall(r"'([^']+)'", mesh_form.group(4))]
        kept = [i for i in range(len(names)) if i not in reduced]
        grouped = ids.transpose(kept + reduced).reshape(-1, math.prod(sizes[i] for i in reduced))
        return [tuple(g) for g in grouped.tolist()]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        perm = [int(p) for p in iota.group(4).split(",")] if iota.group(4) else None
        ids = _iota_ids([int(d) for d in iota.group(3).split(",")], perm)
        return [tuple(g) for g in ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()]
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        return [tuple(int(i) for i in g.split(",") if i) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    return None


def _axes_by_groups(mesh: Mesh) -> dict[frozenset, tuple[str, ...]]:
    """Every subset of the mesh's non-trivial axes, keyed by the device groups it forms."""
    shape = dict(zip(mesh.axis_names, mesh.devices.shape))
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    live = [a for a in mesh.axis_names if shape[a] > 1]
    table = {}
    for r in range(1, len(live) + 1):
        for subset in itertools.combinations(live, r):
            reduced = [mesh.axis_names.index(a) for a in subset]
            kept = [i for i in range(ids.ndim) if i not in reduced]
            groups = ids.transpose(kept + reduced).reshape(-1, math.prod(shape[a] for a in subset))
            table[frozenset(frozenset(g) for g in groups.tolist())] = subset
    return table


def _within_one_axis(groups, mesh: Mesh) -> tuple[str, ...]:
    """The one mesh axis whose device groups each of `groups` lies inside (a sub-group of it: e.g. the tensor
    ranks sharing a replicated key/value head, jaxpar.parallel.tensor.kv_heads_for_ranks), else ('?',)."""
    if len(groups[0]) < 2:
        return ("?",)
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    for i, axis in enumerate(mesh.axis_names):
        if mesh.devices.shape[i] > 1:
            rows = [set(row) for row in np.moveaxis(ids, i, -1).reshape(-1, mesh.devices.shape[i]).tolist()]
            if all(any(set(g) <= row for row in rows) for g in groups):
                return (axis,)
    return ("?",)


def _permute_axes(line: str, mesh: Mesh) -> tuple[tuple[str, ...], int]:
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1].split("}}")[0] + "}")
    shape = mesh.devices.shape
    moved = set()
    for src, dst in pairs:
        a, b = np.unravel_index(int(src), shape), np.unravel_index(int(dst), shape)
        moved.update(i for i in range(len(shape)) if a[i] != b[i])
    return tuple(mesh.axis_names[i] for i in sorted(moved)), 2


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _ARRAY.findall(type_text) if d in _DTYPE_BYTES]


def collective_ops(compiled, mesh: Mesh) -> list[CollectiveOp]:
    """Every collective in the compiled module, with its mesh axes and executions per step."""
    computations = _split_computations(_hlo_text(compiled))
    counts = _execution_counts(computations)
    by_groups = _axes_by_groups(mesh)
    ops = []
    for name, lines in computations.items():
        if name == "__entry__" or not counts.get(name):
            continue
        for line in lines:
            match = _OP.match(line)
            if not match:
                continue
            op_name, result_type, kind, is_start = match.groups()
            results = _arrays(result_type)
            in_place = result_type.lstrip().startswith("((")  # XLA:GPU's all-reduce-start: ((operands), results)
            if kind == "ragged-all-to-all":
                results = _ragged_rows(results, lines, line)
            elif is_start and (kind != "all-reduce" or in_place) and len(results) >= 2:
                results = results[len(results) // 2:]  # async start: (operands, results) tuple
            if kind == "collective-permute":
                axes, group = _permute_axes(line, mesh)
            else:
                groups = _parse_groups(line) or [tuple(range(mesh.devices.size))]
                group = len(groups[0])
                axes = by_groups.get(frozenset(frozenset(g) for g in groups)) or _within_one_axis(groups, mesh)
            size = sum(math.prod(s) * _DTYPE_BYTES[d] for d, s in results)
            if kind == "reduce-scatter":
                size *= group
            ops.append(CollectiveOp(
                kind=kind, axes=tuple(axes), dtype=results[0][0] if results else "?",
                shapes=tuple(s for _, s in results), bytes=size, group_size=group,
                count=counts[name], computation=name, name=op_name,
            ))
    return ops


def _ragged_rows(results: list, lines: list[str], line: str) -> list:
    """A ragged-all-to-all's rows (operand, output buffer, four offset/size vectors): what moves is known only at
    run time, at most the rows its operand holds, and over the group as many as its outputs take; the smaller of
    the two is the routed rows each way (jaxpar.parallel.expert_exchange sizes one side for the worst case).
    An async start's type holds both; a synchronous one names its operand, whose definition gives its shape."""
    arrays = [a for a in results if a[0] not in ("s32", "s64", "u32", "u64")]
    if len(arrays) < 2:
        operand = re.search(r"ragged-all-to-all\(%?([\w.\-]+)", line)
        defined = operand and next((_arrays(m.group(0)) for m in map(_DEFINITION.match, lines)
                                    if m and m.group(1) == operand.group(1)), None)
        arrays = [*(defined or [])[:1], *arrays]
    return [min(arrays[:2], key=lambda a: math.prod(a[1]))] if arrays else results


def collectives(compiled, mesh: Mesh) -> list[dict]:
    """Collectives per step and device, one row per (kind, mesh axes).

    count: calls per step; buffers: arrays moved (XLA may combine several into
    one call); bytes and traffic: summed over calls (see module docstring).
    """
    rows: dict[tuple, dict] = {}
    for op in collective_ops(compiled, mesh):
        row = rows.setdefault((op.kind, op.axes), {
            "kind": op.kind, "axes": list(op.axes), "count": 0, "buffers": 0, "bytes": 0, "traffic": 0.0,
        })
        row["count"] += op.count
        row["buffers"] += op.count * len(op.shapes)
        row["bytes"] += op.count * op.bytes
        row["traffic"] += op.count * op.traffic
    return sorted(rows.values(), key=lambda r: (KINDS.index(r["kind"]), r["axes"]))


def memory(compiled) -> dict[str, int]:
    """Per-device memory of the compiled step in bytes (XLA's memory analysis)."""
    stats = compiled.memory_analysis()
    arguments, outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
    temp, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
    return {
        "arguments": int(arguments),
        "outputs": int(outputs),
        "alias": int(alias),
        "temp": int(temp),
        "total": int(arguments + outputs - alias + temp),
    }


def flops(compiled) -> float:
    """FLOPs per device per step from XLA's cost analysis, which counts a loop body once whatever its trip count.

    A deviceless GPU compile (a target, jaxpar.core.target) has no cost analysis: there the figure is the
    module's matmuls and fused attention, each counted as often as it runs (`matmul_flops` + `library_flops`).
    """
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - "GetCostAnalysis is not supported" on some backends
        cost = None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return matmul_flops(compiled) + library_flops(compiled)
    return float(cost["flops"])


_CUSTOM = re.compile(r'custom_call_target="(__cublas\$[\w$]+|__cudnn\$fmha\w+)"')
_CONSTRAINTS = re.compile(r"operand_layout_constraints=\{(.*?)\}, api_version")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def library_flops(compiled) -> float:
    """FLOPs per device per step of the matmuls and attention a GPU compile hands to libraries, each counted as
    often as it runs: cuBLAS GEMMs (2 x output x contracted) and cuDNN's fused attention by its operands' shapes,
    counted as the planner counts attention (jaxpar.planner.step_time: the whole [queries, keys] square, forward
    2 b h sq sk (d + dv), backward twice that)."""
    computations = _split_computations(_hlo_text(compiled))
    counts = _execution_counts(computations)
    total = 0.0
    for name, lines in computations.items():
        if not counts.get(name):
            continue
        shapes = {m.group(1): [int(d) for d in m.group(2).split(",") if d] for m in map(_DEFINITION.match, lines) if m}
        for line in lines:
            target = _CUSTOM.search(line)
            if target:
                total += counts[name] * _library_call_flops(target.group(1), line, shapes)
    return total


def _library_call_flops(target: str, line: str, shapes: dict[str, list[int]]) -> float:
    """One cuBLAS or cuDNN call's FLOPs (see `library_flops`), 0 where its shapes cannot be read."""
    if target.startswith("__cublas"):
        result = _arrays(line.split("=", 1)[1].split(" custom-call(", 1)[0])
        lhs = re.search(r"custom-call\(%?([\w.\-]+)", line)
        dims = _CONTRACTING.search(line)
        if not result or not lhs or lhs.group(1) not in shapes or not dims:
            return 0.0
        contracted = math.prod(shapes[lhs.group(1)][int(d.strip('" '))] for d in dims.group(1).split(",") if d.strip())
        return 2.0 * math.prod(result[0][1]) * contracted
    constraints = _CONSTRAINTS.search(line)
    operands = _arrays(constraints.group(1)) if constraints else []
    if len(operands) < 3:
        return 0.0
    (_, q), (_, k), (_, v) = operands[:3]  # [b, s, heads, d] as jax.nn.dot_product_attention passes them
    forward = 2.0 * q[0] * q[2] * q[1] * k[1] * (q[3] + v[3])
    return forward * (2 if "Backward" in target else 1)


def matmul_flops(compiled) -> float:
    """FLOPs per device per step of the compiled step's dot instructions, each counted as often as it runs.

    Unlike `flops`, loop bodies count once per trip (a layer scan, a pipeline's
    tick scan), so steps that scan differently compare. Matmuls a backend hands
    to a library call (cuBLAS custom calls on GPU) are not dots and not counted.
    """
    computations = _split_computations(_hlo_text(compiled))
    counts = _execution_counts(computations)
    dims = lambda text: [int(d) for d in text.split(",") if d]  # noqa: E731
    total = 0.0
    for name, lines in computations.items():
        if not counts.get(name):
            continue
        shapes = {m.group(1): dims(m.group(2)) for m in map(_DEFINITION.match, lines) if m}
        for line in lines:
            dot, out = _DOT.search(line), _DEFINITION.match(line)
            if dot and out and dot.group(1) in shapes:
                contracted = math.prod(shapes[dot.group(1)][i] for i in dims(dot.group(2)))
                total += counts[name] * 2.0 * math.prod(dims(out.group(2))) * contracted
    return total


def residual_ring_bytes(compiled, rows: int) -> int:
    """Bytes per device of the pipeline's residual ring (`rows` rows), 0 without one.

    The ring's buffers are the arrays `jaxpar.pipeline.executor` writes under its
    `RING_SCOPE`, one write each (XLA may merge their initial values with
    other arrays', so those do not name them all); they are counted as the
    tick loops carry them: each array of a ring buffer's shape in the loop state.
    """
    from jaxpar.pipeline.residual_ring import RING_SCOPE

    lines = _hlo_text(compiled).splitlines()
    writes = [line.split("=", 1)[1].split(" dynamic-update-slice(", 1)[0]
              for line in lines if RING_SCOPE in line and " dynamic-update-slice(" in line]
    shapes = {(d, dims) for out in writes for d, dims in _arrays(out) if dims[:1] == (rows,)}
    carried = [_arrays(line.split("=", 1)[1].split(" while(", 1)[0]) for line in lines if " while(" in line]
    return max((sum(math.prod(dims) * _DTYPE_BYTES[d] for d, dims in state if (d, dims) in shapes)
                for state in carried), default=0)


def pipeline_figures(compiled, plan) -> dict | None:
    """The schedule's bubble, the live-microbatch bound and the residual ring's bytes (None without a pipeline).

    live_microbatches counts whole stages' residual sets (a chunk's are 1/v);
    peak_residual_bytes is the ring read from the compiled step (None for
    gpipe, whose residuals autodiff keeps per tick).
    """
    from jaxpar.pipeline.schedule import Schedule

    if plan.shape["pipe"] == 1:
        return None
    schedule = Schedule(plan.schedule, plan.shape["pipe"], plan.pipeline_microbatches, plan.virtual_stages)
    rows = schedule.in_flight
    ring = residual_ring_bytes(compiled, rows) if schedule.explicit_backward else None
    return {
        "schedule": schedule.name, "stages": schedule.stages, "microbatches": schedule.microbatches,
        "virtual_stages": schedule.virtual_stages, "bubble": schedule.bubble,
        "live_microbatches": schedule.live_microbatches, "ring_rows": rows if ring is not None else None,
        "peak_residual_bytes": ring,
    }


def process_axes(mesh: Mesh) -> list[str]:
    """The mesh axes along which devices belong to different processes (hosts): the ones whose traffic crosses DCN."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return [a for i, a in enumerate(mesh.axis_names) if np.any(np.diff(procs, axis=i) != 0)]


def summary(compiled, mesh: Mesh, plan=None) -> dict:
    """The JSON that `jaxpar inspect --json` prints (without the model's own fields); with the plan, its pipeline."""
    out = {
        "mesh": {a: int(s) for a, s in zip(mesh.axis_names, mesh.devices.shape)},
        "process_axes": process_axes(mesh),
        "collectives": collectives(compiled, mesh),
        "memory": memory(compiled),
        "flops": flops(compiled),
        "matmul_flops": matmul_flops(compiled),
    }
    if plan is not None and (figures := pipeline_figures(compiled, plan)) is not None:
        out["pipeline"] = figures
    return out

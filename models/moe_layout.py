"""Which blocks of an MoE Llama are dense and which MoE, and how they are stacked and run.

An MoE Llama's layers are `first_dense` dense blocks (the prefix: its own stack, run with the embedding), then
groups of `moe_every` blocks, each group's blocks the kinds of its `group` pattern in order: `D` dense, `M` MoE
(`moe_pattern`; by default `moe_every - 1` dense blocks then one MoE block). Any set of dense layers is such a
layout: at worst one group holding every layer after the prefix. The dense blocks after the prefix are one stack
and the MoE blocks another, each in layer order, so that parameter paths never depend on the pattern.

A layout runs in one of two forms (`runs_apart`):

- groups: a scan over the groups (each group's layers gathered together under ZeRO-3), each group running its
  homogeneous runs of blocks in order (`runs`). The pipeline cuts the groups into stages, so it splits any
  layout whose groups divide into its stages; moe_every's classic groups always run so.
- runs: a pattern given as one group (no period: dense layers `mlp_only_layers` puts anywhere) runs as its
  homogeneous runs one after another, each a scan over its layers' slice of the stacks (gathered a layer at a
  time under ZeRO-3). No pipeline splits it into equal stages: such a plan is refused (`check_pipeline`).

`layout_of` is the inverse: the shortest group (then the shortest prefix) that makes a given list of kinds.
"""

from __future__ import annotations

KINDS = "DM"


def classic(every: int) -> str:
    """moe_every's own group: every - 1 dense blocks, then one MoE block."""
    return "D" * (every - 1) + "M"


def check(pattern: str, every: int) -> None:
    """ValueError for a `moe_pattern` that cannot act with `moe_every`."""
    if set(pattern) - set(KINDS) or len(pattern) != every or "M" not in pattern:
        raise ValueError(f"moe_pattern={pattern!r} must be moe_every={every} blocks of D (dense) and M (MoE) with at "
                         "least one M (or '' for moe_every - 1 dense blocks, then one MoE block)")


def runs(group: str) -> list[tuple[str, int, int]]:
    """The homogeneous runs of `group` in order: (kind, its first index among the group's blocks of that kind,
    length)."""
    out, seen = [], {kind: 0 for kind in KINDS}
    for i, kind in enumerate(group):
        if i and group[i - 1] == kind:
            out[-1] = (kind, out[-1][1], out[-1][2] + 1)
        else:
            out.append((kind, seen[kind], 1))
        seen[kind] += 1
    return out


def kinds(cfg) -> str:
    """Every layer's kind in order (`D` dense, `M` MoE) of an MoE Llama config."""
    groups = (cfg.n_layers - cfg.first_dense) // cfg.moe_every
    return "D" * cfg.first_dense + (cfg.moe_pattern or classic(cfg.moe_every)) * groups


def runs_apart(cfg) -> bool:
    """Whether the blocks run as their homogeneous runs one after another (a pattern given as one group) rather
    than as a scan over groups."""
    return bool(cfg.moe_pattern) and cfg.n_layers - cfg.first_dense == cfg.moe_every


def layout_of(layer_kinds: str) -> tuple[int, int, str]:
    """(first_dense, moe_every, moe_pattern: '' where it is the classic group) making `layer_kinds`: the shortest
    group, then the shortest prefix; ValueError where no layer is MoE."""
    n = len(layer_kinds)
    if "M" not in layer_kinds:
        raise ValueError(f"no MoE layer among the {n} layers")
    best = None
    for first in range(layer_kinds.index("M") + 1):
        body = layer_kinds[first:]
        every = next(q for q in range(1, len(body) + 1) if len(body) % q == 0 and body == body[:q] * (len(body) // q))
        if best is None or every < best[1]:
            best = (first, every, body[:every])
    first, every, group = best
    return first, every, "" if group == classic(every) else group


def check_pipeline(cfg, stages: int, virtual_stages: int) -> None:
    """ValueError, naming the layers and the stage count, when a pipeline cannot cut a non-classic layout into
    stages that hold the same layers (groups a whole number of which each stage holds)."""
    if not cfg.moe_pattern:
        return
    chunks = stages * virtual_stages
    groups = (cfg.n_layers - cfg.first_dense) // cfg.moe_every
    if groups % chunks == 0 and not runs_apart(cfg):
        return
    layer_kinds = kinds(cfg)
    moe, dense = ([i for i, k in enumerate(layer_kinds) if k == kind] for kind in "MD")
    prefix = f"after the dense prefix 0..{cfg.first_dense - 1} (run with the embedding) " if cfg.first_dense else ""
    raise ValueError(f"MoE layers {moe} and dense layers {dense} of {cfg.n_layers} do not split into pipe={stages} x "
                     f"virtual_stages={virtual_stages} = {chunks} pipeline stages of the same layers: {prefix}the "
                     f"pattern {cfg.moe_pattern!r} repeats {groups} time(s), not a multiple of {chunks}; use a plan "
                     "without a pipeline (pipe=1)")

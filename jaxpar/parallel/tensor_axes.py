"""Which mesh axes a tensor-parallel layer splits over, read off its einsum and its operands' logical names.

Both forms of the Megatron layers (jaxpar.parallel.tensor, jaxpar.parallel.tensor_explicit)
decide from these which dimensions are split, over which axes, and what a region's
input looks like once it is whole.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpar.core.trace import active_plan
from jaxpar.parallel.constrain import rule_axes


@dataclasses.dataclass(frozen=True)
class Einsum:
    """The letters of a two-operand einsum `x,w->out`: which of w's dimensions are contracted or features."""

    x: str
    w: str
    out: str

    @classmethod
    def parse(cls, equation: str) -> Einsum:
        inputs, arrow, out = equation.replace(" ", "").partition("->")
        x, comma, w = inputs.partition(",")
        if not (arrow and comma) or "." in equation:
            raise ValueError(f"tensor-parallel layers take an explicit two-operand einsum 'x,w->out', got {equation!r}")
        return cls(x, w, out)

    @property
    def equation(self) -> str:
        return f"{self.x},{self.w}->{self.out}"

    @property
    def contracted(self) -> str:
        return "".join(c for c in self.w if c in self.x and c not in self.out)

    @property
    def features(self) -> str:
        return "".join(c for c in self.w if c not in self.x)

    def positions(self, letters: str) -> list[int]:
        return [i for i, c in enumerate(self.w) if c in letters]

    def weight_names(self, x_names, out_names) -> tuple:
        """The weight's logical names, read off the names of x and of the output."""
        for operand, letters, names in (("x", self.x, x_names), ("output", self.out, out_names)):
            if len(letters) != len(names):
                raise ValueError(f"{self.equation}: {operand} has {len(letters)} dimensions but {len(names)} names {names}")
        named = {**dict(zip(self.x, x_names)), **dict(zip(self.out, out_names))}
        return tuple(named[c] for c in self.w)

    def out_shape(self, x, w) -> tuple[int, ...]:
        """The output's shape for operands x and w."""
        sizes = {**dict(zip(self.x, x.shape)), **dict(zip(self.w, w.shape))}
        return tuple(sizes[c] for c in self.out)


def region_axes(split_names) -> tuple[str, ...]:
    """The tensor-parallel axes: mesh axes (size > 1) the active rules give the split dimensions."""
    axes: list[str] = []
    for name in split_names:
        axes.extend(a for a in rule_axes(name) if a not in axes)
    return tuple(axes)


def replicated_over(names, axes) -> tuple:
    """The names with every dimension split over the tensor axes made whole (entering a region).

    The residual stream's sequence becomes any activation's (`seq`): whole
    over tensor, still split over `context` (jaxpar.parallel.attention).
    """
    return tuple(("seq" if n == "seq_residual" else None) if set(rule_axes(n)) & set(axes) else n for n in names)


def ways(axes) -> int:
    """How many shards the mesh `axes` cut a dimension into."""
    return math.prod(active_plan().shape[a] for a in axes)

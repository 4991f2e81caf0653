"""What the strategies tell the Plan about themselves: the values an option takes, and checks of a whole plan.

The Plan lives in the core and imports no strategy. Each strategy registers
here when its module is imported (`import jaxpar` imports them all): the
choices of its option (`tensor_form`, `context_form`, `precision`, `remat`,
`offload`), and a check of the plan or of a batch against the plan that only
it can make (a pipeline schedule's stage and microbatch counts, host memory for
offload, a sequence that splits over `context`), and how it wraps the optimizer (precision). This registry is the one piece
of module-level state jaxpar keeps; it is written at import and only read after.
"""

from __future__ import annotations

from collections.abc import Callable

_choices: dict[str, tuple[tuple[str, ...], str]] = {}  # option -> (its values, what an error calls it)
_plan_checks: list[Callable] = []  # check(plan): raises ValueError
_batch_checks: list[Callable] = []  # check(plan, global_batch, seq_len): raises ValueError
_optimizer_wraps: list[Callable] = []  # wrap(optimizer, plan) -> the optimizer the plan's step runs


def register_choices(option: str, choices, called: str | None = None) -> None:
    """The values the Plan field `option` takes; `called` names it in errors (default: the option)."""
    _choices[option] = (tuple(choices), called or option)


def register_plan_check(check: Callable) -> Callable:
    """Run `check(plan)` on every Plan made; it raises ValueError on what it refuses. Usable as a decorator."""
    _plan_checks.append(check)
    return check


def register_batch_check(check: Callable) -> Callable:
    """Run `check(plan, global_batch, seq_len)` in `Plan.check_batch` (seq_len may be None)."""
    _batch_checks.append(check)
    return check


def register_optimizer_wrap(wrap: Callable) -> Callable:
    """`wrap(optimizer, plan)` gives the optimizer a plan's step really runs (precision adds an fp32 master and
    loss scaling), so that the Plan lays out the state that optimizer keeps."""
    _optimizer_wraps.append(wrap)
    return wrap


def check_choice(option: str, value) -> None:
    if option not in _choices:
        raise RuntimeError(f"no strategy registered the choices of plan option {option!r}: import jaxpar first")
    choices, called = _choices[option]
    if value not in choices:
        raise ValueError(f"{called} must be one of {choices}, got {value!r}")


def check_plan(plan) -> None:
    for check in _plan_checks:
        check(plan)


def check_batch(plan, global_batch: int, seq_len: int | None) -> None:
    for check in _batch_checks:
        check(plan, global_batch, seq_len)


def wrapped_optimizer(optimizer, plan):
    for wrap in _optimizer_wraps:
        optimizer = wrap(optimizer, plan)
    return optimizer

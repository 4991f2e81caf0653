"""Reward functions for GRPO: built-in verifiable rewards and one's own, called as TRL calls them.

A reward function takes keyword arguments `prompts` (each completion's prompt, as the record gives it),
`completions` (their texts), `completion_ids` (their token ids) and every other field of the records, one value
per completion (`answer`, ...), and returns one number per completion. `--reward` names a built-in
(`exact_answer`, `format`) or `module:function` importable from the working directory. A function that cannot
be imported, raises, or returns the wrong number of values is refused in one line that names it (and the record).
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def final_answer(text: str) -> str | None:
    """A completion's final answer: inside <answer>...</answer>, after '####', in \\boxed{...}, else its last number."""
    for pattern in (r"<answer>(.*?)</answer>", r"####\s*(.+?)\s*$", r"\\boxed\{([^{}]*)\}"):
        found = re.findall(pattern, text, re.DOTALL)
        if found:
            return normalized(found[-1])
    numbers = NUMBER.findall(text)
    return normalized(numbers[-1]) if numbers else None


def normalized(answer) -> str:
    """An answer compared as text: stripped, thousands commas and a trailing '.0' dropped."""
    text = str(answer).strip().replace(",", "")
    return text[:-2] if re.fullmatch(r"-?\d+\.0", text) else text


def exact_answer(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the completion's final answer equals the record's `answer`, else 0.0."""
    return [float(final_answer(c) == normalized(a)) for c, a in zip(completions, answer)]


def format_reward(prompts, completions, **_) -> list[float]:
    """1.0 where the completion is `<think>...</think> <answer>...</answer>` (DeepSeek-R1's format), else 0.0."""
    return [float(bool(FORMAT.match(c))) for c in completions]


BUILT_IN = {"exact_answer": exact_answer, "format": format_reward}


def load_reward(spec: str) -> tuple[str, Callable]:
    """(name, function) of `--reward`: a built-in's name or `module:function`; ValueError names what is wrong."""
    if spec in BUILT_IN:
        return spec, BUILT_IN[spec]
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"--reward {spec!r}: a built-in ({', '.join(BUILT_IN)}) or module:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - a user's module may raise anything while it is imported
        raise ValueError(f"--reward {spec}: module {module_name!r} cannot be imported ({type(error).__name__}: "
                         f"{error})") from None
    found = getattr(module, function, None)
    if not callable(found):
        raise ValueError(f"--reward {spec}: module {module_name!r} has no function {function!r}")
    return spec, found


def score(rewards: Sequence[tuple[str, Callable]], prompts: list, completions: list[str], completion_ids: list,
          fields: list[dict], where: Sequence[str]) -> np.ndarray:
    """[completions, functions] float32: each reward function on the whole batch, checked.

    `fields`: each completion's record fields; `where`: each completion's record, for the messages.
    """
    names = sorted({k for f in fields for k in f})
    kwargs = {k: [f.get(k) for f in fields] for k in names}
    out = np.zeros((len(completions), len(rewards)), np.float32)
    for j, (name, function) in enumerate(rewards):
        try:
            values = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        except Exception as error:  # noqa: BLE001 - the user's function: its failure is reported, not re-raised
            raise ValueError(f"reward function {name} raised {type(error).__name__}: {error} (on the completions of "
                             f"{where[0]}..{where[-1]})") from None
        values = _numbers(name, values, len(completions))
        out[:, j] = values
    return out


def _numbers(name: str, values, count: int) -> np.ndarray:
    """The values a reward function returned as float32 [count], or a one-line refusal."""
    try:
        array = np.asarray(values, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"reward function {name} must return one number per completion, got "
                         f"{type(values).__name__} with non-numbers") from None
    if array.shape != (count,):
        raise ValueError(f"reward function {name} returned shape {array.shape} for {count} completions: it must "
                         f"return one number per completion")
    if not all(math.isfinite(v) for v in array):
        raise ValueError(f"reward function {name} returned a value that is not finite: {array.tolist()}")
    return array.astype(np.float32)

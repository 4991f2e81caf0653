"""The planner against the compiler: its figures beside those `jaxpar inspect --json` reads from XLA.

What tests/test_planner.py and benchmarks/planner.py hold the analytic model to.
"""

from __future__ import annotations

import math

from jaxpar.planner.estimate import Estimate
from jaxpar.planner.layout import AXES


def compiled_figures(summary: dict) -> dict[str, float]:
    """The quantities the planner predicts, from `jaxpar inspect --json` (jaxpar.run.report.inspection)."""
    out = {"arguments": float(summary["memory"]["arguments"]), "temp": float(summary["memory"]["temp"])}
    for axis in AXES:
        out[f"traffic_{axis}"] = sum(r["traffic"] for r in summary["collectives"] if r["axes"] == [axis])
    out["traffic_other"] = sum(r["traffic"] for r in summary["collectives"] if len(r["axes"]) != 1)
    return out


def predicted_figures(est: Estimate) -> dict[str, float]:
    out = {"arguments": est.memory["arguments"], "temp": est.memory["temp_total"]}
    for axis in AXES:
        out[f"traffic_{axis}"] = est.traffic.get(axis, 0.0)
    return out


def ratios(est: Estimate, summary: dict) -> dict[str, float]:
    """prediction / compiled for argument bytes, temp bytes and traffic per mesh axis (axes with traffic)."""
    got, want = predicted_figures(est), compiled_figures(summary)
    out = {}
    for key, value in got.items():
        if want[key] or value:
            out[key] = value / want[key] if want[key] else math.inf
    return out

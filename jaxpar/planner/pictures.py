"""`jaxpar plan --png`: the top layouts' memory, and the best layout's step time under strong and weak scaling."""

from __future__ import annotations

import math

from jaxpar.planner.layout import Workload
from jaxpar.planner.model import Model, model_seq
from jaxpar.planner.search import Ranking, plan


def save_pictures(ranking: Ranking, prefix: str, top: int = 6) -> list[str]:
    """PNG pictures: memory per device of the top layouts (stacked bars), and step time under strong and
    weak scaling. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    parts = ("params", "grads", "optimizer", "activations", "temp")
    shown = ranking.ranked[:top]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(shown) + 2), 4.5))
    bottom = [0.0] * len(shown)
    for part in parts:
        values = [e.memory[part] / 1e9 for e in shown]
        ax.bar(range(len(shown)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(ranking.device.capacity / 1e9, color="k", ls="--", lw=1, label=f"usable {ranking.device.name}")
    ax.set_xticks(range(len(shown)), [str(e.layout).replace(" ", "\n", 1).replace(" precision", "\nprecision")
                                      for e in shown], fontsize=6)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{ranking.model.name} on {ranking.devices} x {ranking.device.name}: memory of the top layouts",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(f"{prefix}_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    strong, weak = scaling(ranking)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [n for n, _ in strong]
    a1.loglog(xs, [e.step_time if e else float("nan") for _, e in strong], "o-", label="predicted best layout")
    base = next(((n, e.step_time) for n, e in strong if e), None)
    if base:
        a1.loglog(xs, [base[1] * base[0] / n for n in xs], "k:", label="linear scaling")
    a1.set_xlabel("devices")
    a1.set_ylabel("step time (s)")
    a1.set_title(f"strong scaling: {ranking.model.name}, batch {ranking.work.batch_size}", fontsize=9)
    a1.legend(fontsize=7)
    a2.plot(range(len(weak)), [e.step_time if e else float("nan") for _, _, e in weak], "o-")
    a2.set_xticks(range(len(weak)), [f"{name}\n{n} dev" for name, n, _ in weak], fontsize=7)
    a2.set_ylabel("step time (s)")
    a2.set_title("weak scaling: model size at fixed tokens per device", fontsize=9)
    fig.tight_layout()
    paths.append(f"{prefix}_scaling.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def scaling(ranking: Ranking):
    """Best layouts for 1/8 .. 8x the devices at the same batch (strong), and for the registry's model
    sizes with devices grown in proportion to parameters at the same tokens per device (weak)."""
    fast = dict(precision=ranking.ranked[0].layout.precision if ranking.ranked else "bf16")
    strong = []
    for factor in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8):
        n = int(ranking.devices * factor)
        if n < 1 or ranking.work.batch_size * 8 < n:
            continue
        r = plan(ranking.model, n, ranking.work, ranking.device, **fast)
        strong.append((n, r.best))
    weak = []
    tokens_per_device = ranking.work.tokens / ranking.devices
    for name in ("1b", "7b", "70b", "405b"):
        try:
            model = Model.named(name)
        except ValueError:
            continue
        n = max(8, 2 ** round(math.log2(ranking.devices * model.params / ranking.model.params)))
        batch = max(1, int(tokens_per_device * n // model_seq(name)))
        r = plan(model, n, Workload(batch, model_seq(name)), ranking.device, **fast)
        weak.append((name, n, r.best))
    return strong, weak

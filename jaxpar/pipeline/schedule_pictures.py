"""Pictures of a schedule's tick table: rich text for the terminal (`render`) and a PNG (`save_png`).

One row per stage, a cell per slot in time order (`Schedule.timeline`),
coloured by kind (forward, input- or fused backward, weight-backward) and
shaded by virtual chunk; `jaxpar inspect --schedule` prints `render`'s text.
"""

from __future__ import annotations

from jaxpar.pipeline.schedule import EMPTY, Schedule

_FORWARD_COLOURS = ("#4c72b0", "#8172b2", "#64b5cd", "#2a4a80")  # blues, one shade per virtual chunk
_BACKWARD_COLOURS = ("#55a868", "#2f7d4a", "#8cc084", "#1b5e20")  # greens
_WEIGHT_COLOURS = ("#dd8452", "#c44e52", "#e6a06f", "#8c3a1b")  # oranges: weight-backward slots


def _colour(kind: str, chunk: int) -> str:
    palette = {"F": _FORWARD_COLOURS, "W": _WEIGHT_COLOURS}.get(kind, _BACKWARD_COLOURS)
    return palette[chunk % len(palette)]


def _title(schedule: Schedule) -> str:
    v = f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""
    formula = "2(p-1)/(3m+2(p-1))" if schedule.name == "zb-h1" else "(p-1)/(vm+p-1)"
    return (f"{schedule.name}: p={schedule.stages}, m={schedule.microbatches}{v}; "
            f"bubble {schedule.bubble:.1%} (formula {formula} = {schedule.bubble_formula:.1%})")


def render(schedule: Schedule):
    """The timeline as rich text: one row per stage, a coloured cell per forward/backward slot."""
    from rich.text import Text

    width = len(str(schedule.microbatches - 1)) + 1
    text = Text(_title(schedule) + "\n", style="bold")
    columns = schedule.timeline()
    for stage in range(schedule.stages):
        text.append(f"stage {stage} ", style="bold")
        for col in columns:
            j = col.microbatch[stage]
            if j == EMPTY:
                text.append("·".center(width), style="dim")
            else:
                text.append(str(j).rjust(width - 1) + " ", style=f"bold white on {_colour(col.kind, col.chunk[stage])}")
        text.append("\n")
    text.append("forward ", style=f"white on {_FORWARD_COLOURS[0]}")
    text.append(" ")
    split = schedule.explicit_backward and "W" in schedule.actions
    text.append("input-backward" if split else "backward", style=f"white on {_BACKWARD_COLOURS[0]}")
    if split:
        text.append(" ")
        text.append("weight-backward", style=f"white on {_WEIGHT_COLOURS[0]}")
    text.append("  · bubble; numbers are microbatches")
    if schedule.virtual_stages > 1:
        text.append("; shades are virtual chunks")
    text.append(f"\n{_residuals(schedule)}")
    return text


def _residuals(schedule: Schedule) -> str:
    """The live-microbatch bound in words: how many stages' worth of residuals a stage keeps at the peak."""
    if not schedule.explicit_backward:
        return f"residuals kept: all {schedule.microbatches} microbatches' (autodiff of the tick scan)"
    chunks = f" ({schedule.in_flight} chunk-sized sets)" if schedule.virtual_stages > 1 else ""
    text = f"residuals kept: at most {schedule.live_microbatches:g} microbatches' per stage{chunks}"
    if schedule.cotangents_in_flight:
        extra = schedule.ring_layout().cotangent_buffer_rows
        text += f"; up to {schedule.cotangents_in_flight} cotangents kept from B to W, in ring rows no residuals hold"
        text += f" ({extra} rows of their own where none is free)" if extra else ""
    return text


def save_png(schedule: Schedule, path: str) -> None:
    """Draw the timeline with matplotlib (stages x slots, bubbles left blank) into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    columns = schedule.timeline()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(columns)), 0.55 * schedule.stages + 1.3))
    for x, col in enumerate(columns):
        for stage, j in enumerate(col.microbatch):
            if j == EMPTY:
                continue
            ax.add_patch(plt.Rectangle((x, stage), 0.95, 0.9, color=_colour(col.kind, col.chunk[stage])))
            ax.text(x + 0.47, stage + 0.45, str(j), ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, len(columns))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(schedule.stages, 0)
    ax.set_yticks([s + 0.45 for s in range(schedule.stages)], [f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel("time slot (one forward or backward slot of one chunk)")
    ax.set_title(_title(schedule), fontsize=9)
    split = schedule.explicit_backward and "W" in schedule.actions
    handles = [Patch(color=_FORWARD_COLOURS[0], label="forward"),
               Patch(color=_BACKWARD_COLOURS[0], label="input-backward" if split else "backward")]
    if split:
        handles.append(Patch(color=_WEIGHT_COLOURS[0], label="weight-backward"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, bbox_to_anchor=(1.0, -0.25), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`--tensorboard DIR`: the training metrics as TensorBoard scalars (tensorboardX: event files, no TensorFlow).

One scalar per metric and step, under TensorBoard's usual groups: `train/loss`,
`train/lr`, `train/grad_norm`, `perf/tokens_per_s`, `perf/step_time_s`,
`perf/mfu` (only where MFU is meaningful), `memory/*` (only where the backend
reports it), `eval/*`; a preference objective's `rewards/*` and `logps/*`. The JSON-lines
`--metrics` file carries the same rows.
"""

from __future__ import annotations

from pathlib import Path

# Where each metric of a training row goes; other numeric keys land under train/.
GROUPS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "nonfinite_steps": "train/nonfinite_steps",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
    "memory_bytes_in_use": "memory/bytes_in_use", "memory_peak_bytes_in_use": "memory/peak_bytes_in_use",
    # preference objectives (jaxpar.objectives), under TRL's names
    "chosen_reward": "rewards/chosen", "rejected_reward": "rewards/rejected", "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies", "chosen_logps": "logps/chosen", "rejected_logps": "logps/rejected",
}
SKIPPED = ("step", "nonfinite", "saved", "preempted")  # bookkeeping, not curves


def tag(key: str) -> str:
    """The TensorBoard tag of a metric key."""
    if key in GROUPS:
        return GROUPS[key]
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + key


class TensorBoard:
    """An event-file writer for training rows; open it on process 0 only."""

    def __init__(self, directory: str | Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(directory))

    def write(self, row: dict) -> None:
        """Every finite-or-not float/int of a training row (not bools, lists or bookkeeping) at row['step']."""
        step = int(row["step"])
        for key, value in row.items():
            if key in SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(tag(key), float(value), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

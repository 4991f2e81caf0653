"""One training step and what surrounds it: precision, state, step, checkpoints, distributed start-up."""

from jaxpar.train import rank_report as _rank_report  # noqa: E402,F401 (in a job, watches sys.exit from the start)

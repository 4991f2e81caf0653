"""One training step and what surrounds it: precision, state, step, checkpoints, distributed start-up."""

"""One training step and what surrounds it: precision, state, step, checkpoints, data, distributed start-up."""

"""A run from the command line: the training loop, evaluation, generation, and what they print."""

"""A run's data, from a spec to global batches: sources and record indexes, tokenizers and chat templates, packing
and blocks, epochs and mixtures, the evaluation hold-out, read-ahead, the counts shared between processes.

It stands on `core` only; `train`, `run` and one's own loop read data through `jaxpar.data.stream`.
"""

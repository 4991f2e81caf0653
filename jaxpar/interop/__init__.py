"""Weights in and out: Hugging Face checkpoints and configs, consolidated export."""

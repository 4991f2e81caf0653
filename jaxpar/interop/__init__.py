"""Weights and text in and out: Hugging Face checkpoints, consolidated export, tokenizers."""

"""Quantized weight formats read from checkpoints (FP8 block scales)."""

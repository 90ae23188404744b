"""The drafter a config names."""

from __future__ import annotations

import torch

from runtime.config import RunnerConfig
from runtime.speculative import ALGORITHMS
from runtime.speculative.drafter import Drafter
from runtime.speculative.ngram import NgramDrafter


def make_drafter(cfg: RunnerConfig, rows: int, device: torch.device) -> Drafter:
    """The drafter `cfg.speculative_algorithm` names, for `rows` request rows (row 0 included)."""
    name, k = cfg.speculative_algorithm, cfg.speculative_num_draft_tokens
    if k < 1:
        raise ValueError(f"--speculative-num-draft-tokens must be at least 1, got {k}")
    if name == "ngram":
        lo, hi = cfg.speculative_ngram_sizes
        return NgramDrafter(k, rows, cfg.max_model_len, device, min_n=lo, max_n=hi)
    if name in ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {name} is not available yet; choose ngram")
    raise ValueError(f"unknown --speculative-algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")

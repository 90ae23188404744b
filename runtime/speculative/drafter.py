"""The drafter contract: after each step a request row sampled in, propose up to `max_draft` tokens that
the row's next step may verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.mailbox.messages import SeqStart


@dataclass(frozen=True)
class StepTokens:
    """What one step produced for the rows that sampled: each row's emitted tokens (its accepted drafts
    and the target's own token), which continue its sequence."""

    rows: torch.Tensor  # [B] request rows
    tokens: torch.Tensor  # [B, W] emitted tokens, the first count[i] of row i valid
    counts: torch.Tensor  # [B]


@dataclass(frozen=True)
class Drafts:
    """Proposals for the rows of a StepTokens: `tokens[i, :count[i]]`, with the drafter's confidence in
    each (the probability it puts on the target accepting it, given the ones before)."""

    tokens: torch.Tensor  # [B, max_draft]
    counts: torch.Tensor  # [B]
    confidence: torch.Tensor  # [B, max_draft] in [0, 1]


class Drafter(ABC):
    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def register(self, start: SeqStart) -> None:
        """A request enters `start.row` (prompt, and outputs so far after a retraction)."""
        return

    def release(self, row: int) -> None:
        """The request in `row` left."""
        return

    @abstractmethod
    def propose(self, step: StepTokens) -> Drafts:
        """Drafts for each row of `step`, which continue its emitted tokens."""

"""The drafter contract: a drafter proposes up to `max_draft` tokens that a request row's next step may
verify. It sees every step's emitted tokens and drafts right after the step (`observe`), from the
device's own record of each row (its emitted tokens and lengths, no host reads): a row's next step may
then be planned before this step's counts reach the host (overlap, `StepPlan.assume_accepted`), its
drafts following whatever was accepted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.gpu.forward_batch import ForwardBatch, GraphStep
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
    """Proposals for some rows: `tokens[i, :count[i]]`, with the drafter's confidence in each (its
    estimate of the probability that the target accepts it, given the ones before)."""

    tokens: torch.Tensor  # [B, max_draft]
    counts: torch.Tensor  # [B]
    confidence: torch.Tensor  # [B, max_draft] in [0, 1]


class TokenHistory:
    """Each request row's tokens on the device (`ids` [rows, max_len]: the prompt, then every emitted
    token), appended by each step's outputs without a host round trip."""

    def __init__(self, rows: int, max_len: int, device: torch.device) -> None:
        self.ids = torch.full((rows, max_len), -1, dtype=torch.int64, device=device)
        self.length = torch.zeros(rows, dtype=torch.int64, device=device)

    def register(self, start: SeqStart) -> None:
        ids = list(start.prompt_ids) + list(start.output_ids)
        n = min(len(ids), self.ids.shape[1])
        if n:
            tokens = torch.tensor(ids[len(ids) - n :], dtype=torch.int64)
            self.ids[start.row, :n] = tokens.to(self.ids.device, non_blocking=True)
        self.length[start.row] = n

    def append(self, step: StepTokens) -> None:
        rows, width, max_len = step.rows, step.tokens.shape[1], self.ids.shape[1]
        cols = self.length[rows][:, None] + torch.arange(width, device=rows.device)
        keep = (torch.arange(width, device=rows.device) < step.counts[:, None]) & (cols < max_len)
        cols = cols.clamp(max=max_len - 1)
        current = self.ids[rows[:, None], cols]
        self.ids[rows[:, None], cols] = torch.where(keep, step.tokens, current)
        self.length[rows] = (self.length[rows] + step.counts).clamp(max=max_len)


class Drafter(ABC):
    # True when `observe` is device work of fixed shapes for fixed input shapes (no host reads, no
    # allocation that depends on values): it may then run as a CUDA graph (observe_graph.py)
    graph_safe: bool = False
    # drafters that follow every target forward (MTP, DSpark, the draft model): the runner hands them each
    # forward's batch and final hidden states (`capture`), inside the decode and verify CUDA graphs too
    follows_target: bool = False
    # target layers whose outputs `capture` reads from `batch.taps` (DSpark's context features)
    taps: tuple[int, ...] = ()
    # True when the drafter wants `before_verify` before each step that verifies drafts
    wants_verify_rows: bool = False

    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft

    def capture(self, batch: ForwardBatch, hidden: torch.Tensor, graph: GraphStep | None = None) -> None:
        """After a forward of the target over `batch`: the final hidden states [T, D] of its tokens (their
        KV slots `batch.out_loc`, positions `batch.positions`); only called when `follows_target`. Device
        work of fixed shapes only (no host reads): it is captured into the target's CUDA graphs, whose
        padding tokens write the padding slot 0; `graph`: such a step's shape (its batch has no host
        lists)."""
        return

    def register(self, start: SeqStart) -> None:
        """A request enters `start.row` (prompt, and outputs so far after a retraction)."""
        return

    def release(self, row: int) -> None:
        """The request in `row` left."""
        return

    def restore(self, step: StepTokens) -> None:
        """Right after a step, before `observe` or `record` and outside any CUDA graph: per-row state
        the step's rejected places overwrote (saved by `before_verify`), back, from its counts."""
        return

    @abstractmethod
    def observe(self, step: StepTokens) -> Drafts:
        """Right after a step: its emitted tokens, and the drafts (or what will be drafted) for its rows."""

    def record(self, step: StepTokens) -> None:
        """Right after a step none of whose rows will verify the drafts made now (`StepPlan.propose`):
        keep what later drafts need of its tokens, and draft nothing if that saves work. By default it
        drafts as `observe` does and drops the drafts."""
        self.observe(step)

    def before_verify(self, rows: torch.Tensor, first: torch.Tensor) -> None:
        """Just before a step's forward, when `wants_verify_rows`: its verifying rows [V] and each one's
        first fed position [V] on the device (where it really is, for a row planned ahead)."""
        return

"""A launched step whose results are still on their way to the host."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.mailbox.messages import StepOutput


@dataclass
class Copies:
    """Host copies in flight. Per sampled row: `tokens` [B, W] (W = 1 unless a row verified drafts;
    then `counts` [B] says how many of each row's are emitted), their logprobs and top alternatives, and
    with a drafter its next proposals' counts and confidences."""

    tokens: torch.Tensor
    counts: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # [B, W]
    top_ids: torch.Tensor | None = None  # [B, W, kmax]
    top_logprobs: torch.Tensor | None = None
    draft_counts: torch.Tensor | None = None  # [B]
    draft_conf: torch.Tensor | None = None  # [B, max_draft]

    @classmethod
    def start(cls, **tensors: torch.Tensor | None) -> Copies:
        """Non-blocking device-to-host copies of the given tensors (None stays None)."""
        return cls(**{k: None if t is None else t.to("cpu", non_blocking=True) for k, t in tensors.items()})


@dataclass
class PendingStep:
    step: int
    rows: list[int]  # rows that sampled, in plan order
    copies: Copies | None
    top_counts: list[int] | None
    start: torch.cuda.Event | None  # device timing (CUDA only)
    end: torch.cuda.Event | None
    t0: float  # host time the launch began
    t_ref: torch.cuda.Event | None  # the runner's first event: device times count from it
    # called with (rows, emitted counts) once they are on the host (a verify step's sampler bookkeeping)
    on_counts: Callable[[list[int], list[int]], None] | None = None
    # the drafter's time after this step: host seconds, or on CUDA its start and end events
    draft: float | tuple[torch.cuda.Event, torch.cuda.Event] = 0.0

    def result(self) -> StepOutput:
        """Wait for this step's copies (only this step's: later launched steps keep running)."""
        if self.end is not None:
            self.end.synchronize()
        gpu_start = gpu_end = 0.0
        if self.start is not None and self.t_ref is not None:
            gpu_start = self.t_ref.elapsed_time(self.start) / 1e3
            gpu_end = self.t_ref.elapsed_time(self.end) / 1e3
        draft_s = (
            self.draft if isinstance(self.draft, float) else self.draft[0].elapsed_time(self.draft[1]) / 1e3
        )
        times = dict(
            forward_s=time.perf_counter() - self.t0, gpu_start=gpu_start, gpu_end=gpu_end, draft_s=draft_s
        )
        c = self.copies
        if c is None:
            return StepOutput(self.step, [], [], **times)
        tokens = c.tokens.tolist()
        counts = c.counts.tolist() if c.counts is not None else [1] * len(self.rows)
        if c.counts is not None and self.on_counts is not None:
            self.on_counts(self.rows, counts)
        flat = [t for row, n in zip(tokens, counts, strict=True) for t in row[:n]]
        spec = {}
        if c.counts is not None:
            spec["counts"] = counts
        if c.draft_counts is not None:
            spec["draft_counts"] = c.draft_counts.tolist()
            spec["draft_conf"] = [
                conf[:n] for conf, n in zip(c.draft_conf.tolist(), spec["draft_counts"], strict=True)
            ]
        if c.logprobs is None:
            return StepOutput(self.step, self.rows, flat, **times, **spec)
        k = self.top_counts or [0] * len(self.rows)
        lps = [x for row, n in zip(c.logprobs.tolist(), counts, strict=True) for x in row[:n]]
        per_token_k = [kk for kk, n in zip(k, counts, strict=True) for _ in range(n)]
        ids = _rows(c.top_ids, counts) if c.top_ids is not None else [[] for _ in lps]
        top = _rows(c.top_logprobs, counts) if c.top_logprobs is not None else [[] for _ in lps]
        return StepOutput(
            self.step, self.rows, flat, lps,
            [x[:kk] for x, kk in zip(ids, per_token_k, strict=True)],
            [x[:kk] for x, kk in zip(top, per_token_k, strict=True)],
            **times, **spec,
        )  # fmt: skip


def _rows(t: torch.Tensor, counts: list[int]) -> list[list]:
    """[B, W, k] -> the emitted tokens' rows, flattened in row order."""
    return [x for row, n in zip(t.tolist(), counts, strict=True) for x in row[:n]]

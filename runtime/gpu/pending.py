"""A launched step whose results are still on their way to the host."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from runtime.mailbox.messages import StepOutput


@dataclass
class PendingStep:
    step: int
    rows: list[int]  # rows that sampled, in plan order
    copies: list[torch.Tensor | None]  # host copies in flight: tokens, logprobs, top ids, top logprobs
    top_counts: list[int] | None
    start: torch.cuda.Event | None  # device timing (CUDA only)
    end: torch.cuda.Event | None
    t0: float  # host time the launch began
    t_ref: torch.cuda.Event | None  # the runner's first event: device times count from it

    def result(self) -> StepOutput:
        """Wait for this step's copies (only this step's: later launched steps keep running)."""
        if self.end is not None:
            self.end.synchronize()
        gpu_start = gpu_end = 0.0
        if self.start is not None and self.t_ref is not None:
            gpu_start = self.t_ref.elapsed_time(self.start) / 1e3
            gpu_end = self.t_ref.elapsed_time(self.end) / 1e3
        forward_s = time.perf_counter() - self.t0
        if not self.rows:
            return StepOutput(self.step, [], [], forward_s=forward_s, gpu_start=gpu_start, gpu_end=gpu_end)
        tokens, logprobs, top_ids, top_lps = self.copies
        out = StepOutput(
            self.step, self.rows, tokens.tolist(), forward_s=forward_s, gpu_start=gpu_start, gpu_end=gpu_end
        )
        if logprobs is None:
            return out
        counts = self.top_counts or [0] * len(self.rows)
        ids = top_ids.tolist() if top_ids is not None else [[] for _ in self.rows]
        lps = top_lps.tolist() if top_lps is not None else [[] for _ in self.rows]
        return StepOutput(
            self.step, self.rows, out.tokens, logprobs.tolist(),
            [x[:k] for x, k in zip(ids, counts, strict=True)],
            [x[:k] for x, k in zip(lps, counts, strict=True)],
            forward_s, gpu_start, gpu_end,
        )  # fmt: skip

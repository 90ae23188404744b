"""N-gram (prompt lookup) drafting on the device: the continuation of the most recent earlier occurrence
of a request's last n tokens, n from `max_n` down to `min_n`, becomes its drafts.

Each request row keeps its token history on the device (`TokenHistory`), appended by the step's own
outputs without a host round trip, so drafting needs nothing from the host and a step's drafts are ready
as soon as its tokens are. The search looks at the last
`window` tokens of a row: the n-grams of that window are compared with the row's last n tokens in one
batched pass (no per-row loop), and the latest match wins."""

from __future__ import annotations

import torch

from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory


class NgramDrafter(Drafter):
    graph_safe = True

    def __init__(
        self,
        max_draft: int,
        rows: int,
        max_len: int,
        device: torch.device,
        min_n: int = 1,
        max_n: int = 4,
        window: int = 2048,
    ) -> None:
        super().__init__(max_draft)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.window = min(window, max_len)
        self.history = TokenHistory(rows, max_len, device)

    def register(self, start: SeqStart) -> None:
        self.history.register(start)

    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        return self._lookup(step.rows)

    def record(self, step: StepTokens) -> None:
        self.history.append(step)  # the lookup (most of the work) only when its drafts may be verified

    def _lookup(self, rows: torch.Tensor) -> Drafts:
        """For every row: the latest earlier match of its last n tokens (longest n first) and the up to
        `max_draft` tokens after it."""
        device, w, k = rows.device, self.window, self.max_draft
        length = self.history.length[rows]
        pos = length[:, None] - w + torch.arange(w, device=device)  # [B, W]: the row's last w positions
        tail = torch.where(pos >= 0, self.history.ids[rows[:, None], pos.clamp(min=0)], -1)
        best = torch.full_like(length, -1)  # the continuation's first column in `tail`, -1: none yet
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= w:
                continue
            grams = tail.unfold(1, n, 1)  # [B, W - n + 1, n]
            found = (grams == tail[:, None, w - n :]).all(-1)
            found[:, w - n] = False  # the pattern itself
            found &= (length >= n)[:, None]
            starts = torch.arange(w - n + 1, device=device)
            latest = torch.where(found, starts, -1).amax(-1)
            best = torch.where((best < 0) & (latest >= 0), latest + n, best)
        count = torch.where(best >= 0, (w - best).clamp(max=k), 0)
        cols = (best.clamp(min=0)[:, None] + torch.arange(k, device=device)).clamp(max=w - 1)
        tokens = tail.gather(1, cols).clamp(min=0)
        valid = torch.arange(k, device=device)[None, :] < count[:, None]
        return Drafts(torch.where(valid, tokens, 0), count, valid.float())

"""Random MLA prefill inputs (expanded per-head K/V, ragged rows) for the tests and the benchmark.

With `gaps`, one token separates consecutive rows in q, k and v, and those tokens hold NaN: a kernel
that reads past a row's end poisons its output. `strided` makes v a slice of a wider buffer (row and
head strides that are not the contiguous ones)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillCase:
    q: torch.Tensor  # [T, H, dqk]
    k: torch.Tensor  # [S, H, dqk]
    v: torch.Tensor  # [S, H, dv]
    q_starts: torch.Tensor  # [B] int32
    q_lens: torch.Tensor
    kv_starts: torch.Tensor
    kv_lens: torch.Tensor
    scale: float
    max_q_len: int
    row_tokens: torch.Tensor  # [sum q_lens] the indices of q's tokens that belong to a row

    def args(self) -> tuple:
        cols = (self.q_starts, self.q_lens, self.kv_starts, self.kv_lens)
        return (self.q, self.k, self.v, *cols, self.scale, self.max_q_len)

    @property
    def flops(self) -> float:
        """2 (d_qk + d_v) H per (query, key it attends): query i of a row attends prefix + i + 1 keys."""
        attended = sum(
            (m - n) * n + n * (n + 1) // 2
            for n, m in zip(self.q_lens.tolist(), self.kv_lens.tolist(), strict=True)
        )
        heads, d_qk, d_v = self.q.shape[1], self.q.shape[2], self.v.shape[2]
        return 2.0 * (d_qk + d_v) * heads * attended

    @property
    def nbytes(self) -> float:
        """Q, K, V read once and O written once (the rows' tokens only)."""
        heads, d_qk, d_v = self.q.shape[1], self.q.shape[2], self.v.shape[2]
        tokens, keys = int(self.q_lens.sum()), int(self.kv_lens.sum())
        return (tokens * heads * (d_qk + d_v) + keys * heads * (d_qk + d_v)) * self.q.element_size()


def prefill_case(
    prefix_lens: list[int],
    q_lens: list[int],
    heads: int,
    d_qk: int,
    d_v: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    gaps: bool = True,
    strided: bool = False,
) -> PrefillCase:
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    gap = int(gaps)
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    q_starts = [sum(q_lens[:b]) + gap * (b + 1) for b in range(len(q_lens))]
    kv_starts = [sum(kv_lens[:b]) + gap * (b + 1) for b in range(len(kv_lens))]
    num_tokens, num_keys = sum(q_lens) + gap * (len(q_lens) + 1), sum(kv_lens) + gap * (len(kv_lens) + 1)

    def rand(n: int, d: int, starts: list[int], lens: list[int], extra: int = 0) -> torch.Tensor:
        x = torch.randn(n, heads, d + extra, generator=gen, device=dev).to(dtype)
        if gaps:
            used = torch.zeros(n, dtype=torch.bool)
            for s, m in zip(starts, lens, strict=True):
                used[s : s + m] = True
            x[~used.to(dev)] = float("nan")
        return x[..., :d]

    q = rand(num_tokens, d_qk, q_starts, q_lens)
    k = rand(num_keys, d_qk, kv_starts, kv_lens)
    v = rand(num_keys, d_v, kv_starts, kv_lens, extra=8 if strided else 0)
    parts = [torch.arange(s, s + n) for s, n in zip(q_starts, q_lens, strict=True)]
    row_tokens = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    cols = torch.tensor([q_starts, q_lens, kv_starts, kv_lens], dtype=torch.int32).to(dev)
    return PrefillCase(
        q, k, v, *cols.unbind(0), d_qk**-0.5, max(q_lens, default=0), row_tokens.to(dev)
    )  # fmt: skip

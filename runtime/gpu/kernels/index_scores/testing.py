"""Random Lightning-Indexer inputs for the `index_scores` and `row_index_scores` tests, and their closeness.

`index_case`: T consecutive queries at positions prefix .. prefix + T - 1 of one request over N
compressed entries; query t sees the entries w < (position + 1) // rate (so the first ones of a request
see none). `row_case`: a decode or verify step, rows of q_len places at their own lengths over their own
entries, scattered through a shared key pool. Weights are scaled as the model scales them
(heads^-1/2 c^-1/2), so scores are of order one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.kernels.testing import close_ratio


@dataclass
class IndexCase:
    q: torch.Tensor  # [T, H, c]
    weights: torch.Tensor  # [T, H] float32
    keys: torch.Tensor  # [N, c]
    visible: torch.Tensor  # [T] int32

    def args(self) -> tuple:
        return (self.q, self.weights, self.keys, self.visible)


def index_case(
    tokens: int,
    heads: int,
    dim: int,
    entries: int,
    dtype: torch.dtype,
    device: torch.device | str,
    prefix: int = 0,
    rate: int = 4,
    seed: int = 0,
) -> IndexCase:
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen, device=dev).to(dtype)
    weights = torch.randn(tokens, heads, generator=gen, device=dev) * (heads * dim) ** -0.5
    keys = torch.randn(entries, dim, generator=gen, device=dev).to(dtype)
    visible = ((torch.arange(prefix, prefix + tokens, device=dev) + 1) // rate).clamp(max=entries).int()
    return IndexCase(q, weights, keys, visible)


def score_ratio(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
    """`close_ratio` over the scores of visible entries; inf unless both put -inf at the same places."""
    hidden = expected == float("-inf")
    if not torch.equal(actual == float("-inf"), hidden):
        return float("inf")
    return close_ratio(actual[~hidden], expected[~hidden], atol, rtol)


@dataclass
class RowCase:
    q: torch.Tensor  # [G * q_len, H, c]
    weights: torch.Tensor  # [G * q_len, H] float32
    keys: torch.Tensor  # [P, c] the pool
    table: torch.Tensor  # [G, W] int32 pool rows (past a row's entries: out of the pool)
    visible: torch.Tensor  # [G * q_len] int32

    def args(self) -> tuple:
        return (self.q, self.weights, self.keys, self.table, self.visible)


def row_case(
    lengths: list[int],
    q_len: int,
    heads: int,
    dim: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
    rate: int = 4,
    seed: int = 0,
) -> RowCase:
    """Rows whose places sit at lengths[g] .. lengths[g] + q_len - 1 (each sees (position + 1) // rate
    entries, at most `width`; a length of -q_len makes a padding row that sees none), every row's entries
    at distinct random pool rows. Table entries past a row's entries hold a row past the pool's end, which
    a kernel reading them would fault on (CUDA) or read garbage from."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    groups, tokens = len(lengths), len(lengths) * q_len
    pool = groups * width + 7
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(tokens, heads, generator=gen) * (heads * dim) ** -0.5
    keys = torch.randn(pool, dim, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[: groups * width].view(groups, width).int()
    pos = torch.tensor(lengths)[:, None] + torch.arange(q_len)[None, :]
    visible = torch.where(pos >= 0, (pos + 1) // rate, 0).clamp(max=width).flatten().int()
    seen = visible.view(groups, q_len).amax(1)
    table = torch.where(torch.arange(width)[None, :] < seen[:, None], table, pool + 1000).int()
    return RowCase(*(t.to(dev) for t in (q, weights, keys, table, visible)))

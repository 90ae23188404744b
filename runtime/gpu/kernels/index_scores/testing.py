"""Random Lightning-Indexer inputs for the `index_scores` tests and the benchmark, and their closeness.

T consecutive queries at positions prefix .. prefix + T - 1 of one request over N compressed entries;
query t sees the entries w < (position + 1) // rate (so the first ones of a request see none). Weights
are scaled as the model scales them (heads^-1/2 c^-1/2), so scores are of order one."""

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

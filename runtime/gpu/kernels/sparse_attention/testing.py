"""Random DeepSeek-V4-shaped inputs for the sparse attention tests and the benchmark, and the dense
attention over a mask (`attend_with_sink`) the reference is checked against.

T consecutive tokens at positions prefix .. prefix + T - 1 of one request. Token p selects its sliding
window (the K=V rows of positions p - window + 1 .. p, -1 below position 0) and `topk` compressed
entries out of those it may see (w < (p + 1) // rate), -1 where fewer exist. One source: both live in
one pool, rows [0, P) positions and [P, P + E) entries; two sources: window pool and entry pool.

Poison: the row before each pool (what index -1 would read) and the last rows of each pool, which no
index names, hold NaN; with `ragged`, indices past a token's `topk_length` point at them too. A kernel
that reads a row it was not given turns its output NaN."""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON_ROWS = 4


def attend_with_sink(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense DeepSeek-V4 attention: q [L, H, d], kv [K, d] (keys = values), mask [L, K] bool, sinks [H]
    -> [L, H, d], the softmax over the kept keys and the sink (which adds no value)."""
    logits = torch.einsum("lhd,kd->hlk", q, kv) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hlk,kd->lhd", probs.to(kv.dtype), kv)


@dataclass
class SparseCase:
    q: torch.Tensor  # [T, H, d]
    kv: torch.Tensor  # [S, d]: window rows then entries, or the window rows alone (two sources)
    indices: torch.Tensor  # [T, K] int32
    sinks: torch.Tensor  # [H] float32
    scale: float
    topk_length: torch.Tensor | None = None
    extra_kv: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None

    def args(self) -> tuple:
        return (self.q, self.kv, self.indices, self.sinks, self.scale)

    def kwargs(self) -> dict:
        kw = {"topk_length": self.topk_length}
        if self.extra_kv is not None:
            kw.update(extra_kv=self.extra_kv, extra_indices=self.extra_indices)
        return kw

    @property
    def selected(self) -> int:
        """Valid (token, row) pairs: the rows the kernel must gather."""
        n = int((self.indices >= 0).sum())
        if self.topk_length is not None:
            cols = torch.arange(self.indices.shape[1], device=self.indices.device)
            n = int(((self.indices >= 0) & (cols[None, :] < self.topk_length[:, None])).sum())
        return n + (0 if self.extra_indices is None else int((self.extra_indices >= 0).sum()))


def _pool(rows: int, dim: int, dtype: torch.dtype, device, gen) -> torch.Tensor:
    """[rows, dim] random, a view one row into a buffer whose first and last POISON_ROWS rows are NaN."""
    buf = torch.randn(rows + 1 + POISON_ROWS, dim, generator=gen, device=device).to(dtype)
    buf[0] = float("nan")
    buf[rows + 1 :] = float("nan")
    return buf[1 : rows + 1 + POISON_ROWS]


def sparse_case(
    tokens: int,
    heads: int,
    dim: int,
    window: int,
    topk: int,
    dtype: torch.dtype,
    device: torch.device | str,
    prefix: int = 0,
    rate: int = 4,
    two_sources: bool = False,
    ragged: bool = False,
    seed: int = 0,
    nan_fill: bool = True,
) -> SparseCase:
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    positions = torch.arange(prefix, prefix + tokens, device=dev)
    num_pos, num_entries = prefix + tokens, max(1, (prefix + tokens) // rate)
    win = positions[:, None] - window + 1 + torch.arange(window, device=dev)[None, :]  # [T, window]
    win = torch.where(win >= 0, win, -1)
    visible = (positions + 1) // rate  # entries w < visible[t]
    score = torch.rand(tokens, num_entries, generator=gen, device=dev)
    score = score.masked_fill(torch.arange(num_entries, device=dev)[None, :] >= visible[:, None], 2.0)
    k = min(topk, num_entries)
    top = score.topk(k, dim=1, largest=False)  # `k` distinct visible entries, invisible ones (score 2) last
    ent = torch.where(top.values < 2.0, top.indices, -1)
    if k < topk:
        ent = torch.cat([ent, ent.new_full((tokens, topk - k), -1)], 1)
    if two_sources:
        kv, extra = _pool(num_pos, dim, dtype, dev, gen), _pool(num_entries, dim, dtype, dev, gen)
        indices, extra_indices = win, ent
    else:
        kv, extra, extra_indices = _pool(num_pos + num_entries, dim, dtype, dev, gen), None, None
        indices = torch.cat([win, torch.where(ent >= 0, ent + num_pos, -1)], 1)
    if not nan_fill:
        kv = torch.nan_to_num(kv)
        extra = None if extra is None else torch.nan_to_num(extra)
    lengths = None
    if ragged:  # per token, a random count of the list is used; the rest point at poison rows
        lengths = torch.randint(0, indices.shape[1] + 1, (tokens,), generator=gen, device=dev)
        lengths[0] = indices.shape[1]
        past = torch.arange(indices.shape[1], device=dev)[None, :] >= lengths[:, None]
        indices = torch.where(past, kv.shape[0] - 1, indices)
    q = torch.randn(tokens, heads, dim, generator=gen, device=dev).to(dtype)
    sinks = torch.randn(heads, generator=gen, device=dev) * 2
    return SparseCase(
        q, kv, indices.int(), sinks, dim**-0.5, lengths.int() if lengths is not None else None, extra,
        None if extra_indices is None else extra_indices.int(),
    )  # fmt: skip

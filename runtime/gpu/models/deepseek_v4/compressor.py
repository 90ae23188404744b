"""V4's KV compressors and the Lightning Indexer (the math; state across steps is the backend's).

A compressor turns every window of `rate` tokens into one entry: per channel, a softmax over the
window's tokens of `gate + position_bias` weights their `kv`; the sum is RMS-normed and roped ("compress"
table) at the window's first position. HCA (rate 128) uses disjoint windows. CSA (rate 4) overlaps:
`kv_proj` / `gate_proj` give two series [Ca | Cb], and entry w pools Ca of window w-1 with Cb of window
w (2 * rate slots; window 0's Ca half is empty). The indexer is a CSA compressor at `index_head_dim`
plus a scorer that picks, per query, the `index_topk` entries CSA attends (`Indexer.select`, in tiles of
entries with a running top-k, for prefill; decode and verify rows: attention_decode.py's `select`)."""

from __future__ import annotations

import torch
from torch import nn

from runtime.gpu.kernels.compress_pool.reference import pool as pool_windows
from runtime.gpu.kernels.index_scores import INDEX_SCORES
from runtime.gpu.layers.linear import MergedLinear
from runtime.gpu.layers.norm import RMSNorm
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope


class Compressor(nn.Module):
    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = width = 2 * dim if overlap else dim
        # the checkpoints' kv_proj and gate_proj, one matmul (the loader fills each part by its name)
        self.kv_gate_proj = MergedLinear(hidden, [width, width], ["kv_proj", "gate_proj"])
        self.position_bias = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.indexer: Indexer | None = None  # CSA's Lightning Indexer

    @property
    def tail_len(self) -> int:
        """Raw tokens a request must keep between steps: the open window, plus the last closed one
        when windows overlap (its Ca half feeds the next entry)."""
        return 2 * self.rate if self.overlap else self.rate

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> raw (kv, gate) [T, width] (column views of one [T, 2 width] product): what a
        request keeps for its open window."""
        return self.kv_gate_proj(x)

    def pool(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        first_window: int | torch.Tensor,
        rope: InterleavedRope,
    ) -> torch.Tensor:
        """Raw kv/gate of whole windows first_window.. [..., n * rate, width] -> entries [..., n, dim]
        (leading dims: independent sequences, e.g. one per decode row, with `first_window` a tensor of
        their shape). With overlap, the first window pools its Cb half alone (callers that have its
        predecessor pass it first and drop that entry). The math is `compress_pool.reference.pool`."""
        return pool_windows(kv, gate, first_window, self.position_bias, self.overlap, self.kv_norm, rope)


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """Lightning Indexer: score[t, w] = sum_h w_h(x_t) n_I^-1/2 ReLU(q_{t,h} . K_w) c^-1/2."""

    def __init__(self, config) -> None:
        rate = config.compress_rates["compressed_sparse_attention"]
        super().__init__(config.hidden_size, config.index_head_dim, rate, True, config.rms_norm_eps)
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.scorer = IndexerScorer(config.hidden_size, self.n_heads)

    def queries(
        self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: InterleavedRope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The roped queries [L, heads, c] of x [L, D] / qr [L, q_lora_rank] at `positions`, and their
        head weights [L, heads] float32 with both scales folded in: score = sum_h weights_h ReLU(q_h . K)."""
        q = rope(self.q_b_proj(qr).view(-1, self.n_heads, self.dim), positions)
        weights = self.scorer.weights_proj(x).float() * (self.n_heads**-0.5 * self.dim**-0.5)
        return q, weights

    def select(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        rope: InterleavedRope,
        entry_tile: int,
    ) -> torch.Tensor:
        """x [L, D], qr [L, q_lora_rank] of one request's queries at `positions`; keys [N, c] its indexer
        entries (at least those the last query sees). -> [L, min(topk, N)] int64: the entries each query
        attends, its top-k of those it sees (w < (position + 1) // rate), -1 where it sees fewer.

        The `index_scores` op scores `entry_tile` entries at a time and a running top-k keeps the best:
        the largest tensor is a tile's float32 scores [L, entry_tile] (plus the op's own bounded chunks),
        never [L, heads, N] or [L, N]."""
        q, weights = self.queries(x, qr, positions, rope)
        score = INDEX_SCORES.get(x.device)
        visible = (positions + 1) // self.rate
        n, rows = keys.shape[0], x.shape[0]
        k = min(self.topk, n)
        best = torch.full((rows, k), float("-inf"), device=x.device)
        picked = torch.full((rows, k), -1, dtype=torch.int64, device=x.device)
        for e0 in range(0, n, entry_tile):
            e1 = min(n, e0 + entry_tile)
            tile = score(q, weights, keys[e0:e1].to(q.dtype), visible - e0)
            top = tile.topk(min(k, e1 - e0), dim=1)  # the tile's best, then merged with the running ones
            best, at = torch.cat([best, top.values], 1).topk(k, dim=1)
            picked = torch.cat([picked, top.indices + e0], 1).gather(1, at)
        return torch.where(best > float("-inf"), picked, -1)

"""Lightning Indexer scores (DeepSeek-V4's CSA): per query t and compressed entry n, sum over indexer
heads h of weights[t, h] * ReLU(q[t, h] . keys[n]), for the entries t may see. The head sum happens
inside the ops, so no [tokens, heads, entries] tensor.

- `index_scores`: one request's queries over one key set (prefill; the caller tiles queries and entries
  and keeps a running top-k: models/deepseek_v4/compressor.py, `Indexer.select`).
- `row_index_scores`: decode and verify steps, every row's places over that row's own entries, read in
  place from the paged key pool through a table (models/deepseek_v4/attention_decode.py, `select`), so
  neither the rows' gathered keys nor their per-head scores are materialised.

Triton on CUDA, then the reference."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class IndexScores(Protocol):
    def __call__(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, c] (unit last stride) and keys [N, c] in one dtype; weights [T, H] float32 (every
        scale folded in); visible [T] int: token t sees entries n < visible[t]. -> [T, N] float32, -inf
        where n >= visible[t]. No device sync."""
        ...


INDEX_SCORES = Op("index_scores", IndexScores)
INDEX_SCORES.register("triton", "runtime.gpu.kernels.index_scores.triton:index_scores", triton_on_cuda)
INDEX_SCORES.register("reference", "runtime.gpu.kernels.index_scores.reference:index_scores", always)


class RowIndexScores(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        table: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """G groups of q_len queries (T = G * q_len; query t is of group t // q_len): q [T, H, c] (unit
        last stride), keys [P, c] a key pool in q's dtype, table [G, W] int: group g's entry w is
        keys[table[g, w]]; weights [T, H] float32; visible [T] int (at most W): query t sees its group's
        entries w < visible[t]. -> [T, W] float32, -inf where w >= visible[t]. Table entries past a
        group's largest visible are never read (they may hold anything). No device sync."""
        ...


ROW_INDEX_SCORES = Op("row_index_scores", RowIndexScores)
ROW_INDEX_SCORES.register(
    "triton", "runtime.gpu.kernels.index_scores.row_triton:row_index_scores", triton_on_cuda
)
ROW_INDEX_SCORES.register("reference", "runtime.gpu.kernels.index_scores.reference:row_index_scores", always)

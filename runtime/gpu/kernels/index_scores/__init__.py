"""Lightning Indexer scores (DeepSeek-V4's CSA, op `index_scores`): per query t and compressed entry n,
sum over indexer heads h of weights[t, h] * ReLU(q[t, h] . keys[n]), for the entries t may see. The
head sum happens inside the op, so no [tokens, heads, entries] tensor: the caller tiles queries and
entries and keeps a running top-k (models/deepseek_v4/compressor.py, `Indexer.select`). Triton on CUDA,
then the reference."""

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

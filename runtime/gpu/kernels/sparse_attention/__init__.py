"""Sparse attention over selected rows (DeepSeek-V4, op `sparse_attention`): q [T, H, d] against the
shared K=V rows each token's index list names (its sliding window and compressed entries), with a
per-head sink. FlashMLA's `flash_mla_sparse_fwd` contract with values = keys. Triton on CUDA, then the
reference."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class SparseAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sinks: torch.Tensor | None,
        scale: float,
        topk_length: torch.Tensor | None = None,
        extra_kv: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_topk_length: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, d] (unit last stride); kv [S, d] (or [S, 1, d]) in q's dtype; indices [T, K] (or
        [T, 1, K]) int32/int64 rows of kv, -1 for none; sinks [H] float32 logits or None; topk_length [T]
        or None: only token t's first topk_length[t] indices count (the rest are ignored, whatever they
        hold). Every head of token t attends the named rows as keys and as values, plus its sink logit,
        which takes probability mass but adds no value. `extra_*`: a second source of the same form,
        attended in the same softmax. Returns [T, H, d] in q's dtype (`out` if given); a token with no
        valid row gets 0. Kernels take grid and shapes from the tensors' sizes: no device sync, CUDA-graph
        safe."""
        ...


SPARSE_ATTENTION = Op("sparse_attention", SparseAttention)
SPARSE_ATTENTION.register(
    "triton", "runtime.gpu.kernels.sparse_attention.triton:sparse_attention", triton_on_cuda
)
SPARSE_ATTENTION.register(
    "reference", "runtime.gpu.kernels.sparse_attention.reference:sparse_attention", always
)

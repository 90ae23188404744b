"""Attention of one new query token per row over its paged KV (flash-decoding split-KV)."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, tilelang_on_hopper, triton_on_cuda


class DecodeAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        num_splits: int | None = None,
        out: torch.Tensor | None = None,
        page_size: int = 1,
        q_len: int = 1,
    ) -> torch.Tensor:
        """q: [B * q_len, Hq, D], q_len tokens per row (unit last stride); row b attends the KV slots
        req_to_token[rows[b], :seq_lens[b]] of k_pool / v_pool ([num_slots, Hkv, D], Hq a multiple of
        Hkv; 16-bit or e4m3 with scale 1) with softmax scale `scale`. Returns [B, Hq, D] in q's dtype,
        written into `out` when given. `num_splits`: how many parts each row's KV is split into
        (flash-decoding); None: the kernel chooses on the host from the batch and req_to_token's width
        (an upper bound on lengths, so no device sync); pass a fixed one under CUDA graphs. `page_size`:
        the pool's page size (kernels that copy whole pages use it). The reference ignores both.
        `q_len` > 1 (verify steps): row b's tokens are its last q_len positions, q[b * q_len + i] at
        position seq_lens[b] - q_len + i, each attending the keys up to its own position."""
        ...


DECODE_ATTENTION = Op("decode_attention", DecodeAttention)
# fp8 (e4m3) pools on Hopper: a stage 1 whose producer warpgroup owns the K/V pipeline; other pools and
# GPUs run the Triton kernel (the TileLang entry falls back to it itself)
DECODE_ATTENTION.register(
    "tilelang", "runtime.gpu.kernels.decode_attention.tilelang:decode_attention", tilelang_on_hopper
)
DECODE_ATTENTION.register(
    "triton", "runtime.gpu.kernels.decode_attention.triton:decode_attention", triton_on_cuda
)
DECODE_ATTENTION.register(
    "reference", "runtime.gpu.kernels.decode_attention.reference:decode_attention", always
)

"""Attention of each row's new tokens over its cached prefix plus the causal new part
(`extend_attention`), and of rows with no cached prefix over their own new tokens (`prefill_attention`)."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class ExtendAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        q_starts: torch.Tensor,
        scale: float,
        max_extend: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], the rows' new tokens concatenated (unit last stride); row b's tokens are
        q[q_starts[b] : +extend_lens[b]] at positions prefix_lens[b] + i. Their K/V are already stored
        in k_pool / v_pool ([num_slots, Hkv, D]): the row's keys are the slots
        req_to_token[rows[b], : prefix + extend], and new token i sees keys 0 .. prefix + i. Rows of one
        token (decode) are fine. Returns [T, Hq, D] in q's dtype (`out` if given). `max_extend`: the
        longest row's new tokens, known on the host, sizes a kernel's grid; None: all of q's tokens
        (correct, some programs idle)."""
        ...


class PrefillAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_starts: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        max_len: int | None = None,
        out: torch.Tensor | None = None,
        cached: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """`ExtendAttention` with the new keys taken from the step's own k, v [T, Hkv, D] (rotated, as
        stored; q's dtype) instead of the pools: row b's new tokens are q[q_starts[b] : +lens[b]] and the
        same tokens of k and v, causal among themselves. `cached` = (k_pool, v_pool, req_to_token, rows,
        prefix_lens): each row's cached prefix, whose keys are the slots
        req_to_token[rows[b], :prefix_lens[b]], seen by all its new tokens; None: no row has one. Only the
        rows' tokens of `out` are written. Returns [T, Hq, D] in q's dtype. `max_len`: the longest row,
        known on the host, sizes a kernel's grid (None: all of q's tokens). Kernels take head dims that
        are powers of two."""
        ...


EXTEND_ATTENTION = Op("extend_attention", ExtendAttention)
EXTEND_ATTENTION.register(
    "triton", "runtime.gpu.kernels.extend_attention.triton:extend_attention", triton_on_cuda
)
EXTEND_ATTENTION.register(
    "reference", "runtime.gpu.kernels.extend_attention.reference:extend_attention", always
)
PREFILL_ATTENTION = Op("prefill_attention", PrefillAttention)
PREFILL_ATTENTION.register(
    "triton", "runtime.gpu.kernels.extend_attention.triton:prefill_attention", triton_on_cuda
)
PREFILL_ATTENTION.register(
    "reference", "runtime.gpu.kernels.extend_attention.reference:prefill_attention", always
)

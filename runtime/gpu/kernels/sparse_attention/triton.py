"""Sparse attention over selected rows (DeepSeek-V4) in Triton (`SparseAttention`).

One program per (token, block of BLOCK_H query heads); a token's head blocks are adjacent in the grid, so
the rows it gathers are read from memory once and from L2 by the other blocks. A program walks the
token's index list BLOCK_N at a time, gathers those rows of the pool ([BLOCK_N, d], one load) and uses
them twice for every head of its block: as keys (S = Q K^T) and as values (O += P V), since V4's KV is
shared. Online softmax in float32, base 2; the sink starts it as a key of value zero (running max =
sink, denominator = 1), so it takes its share of the mass and the end needs no correction. Indices -1
and positions past `topk_length` are masked (not loaded); a block with no valid row leaves the state as
it was. A second source (`extra_kv`, `extra_indices`) continues the same softmax state.

The whole row is one tile (d padded to a power of two): d = 512 with BLOCK_H = 16 is the MLA decode
kernel's tile (`mla_decode/triton.py`), a [16, 512] float32 accumulator per program. Heads are tiled
rather than d, so each gathered row is loaded once per head block and serves as key and value."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, dot_precision, next_pow2
from runtime.gpu.kernels.sparse_attention.reference import indices_2d, rows_2d
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@dataclass(frozen=True)
class SparseConfig:
    block_h: int = 16  # query heads per program (each gathered row is read once per head block)
    block_n: int = 32  # selected rows per inner step
    num_warps: int = 4
    num_stages: int = 2


def default_config(num_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> SparseConfig:
    """Untuned guesses from the MLA decode kernel (16 x 32, 4 warps, 2 stages at d 576); float32 rows
    twice as wide take half the block."""
    if device.type != "cuda":
        return SparseConfig(block_h=16, block_n=16, num_warps=1, num_stages=1)
    if dim <= 128:
        return SparseConfig(block_h=min(64, max(16, next_pow2(num_heads))), block_n=64)
    return SparseConfig(block_n=16 if dtype == torch.float32 else 32)


@triton.jit
def _attend_source(
    m, denom, acc, q, KV, Idx, Len, t, num_idx, stride_kv, stride_it, qk_scale,
    HAS_LEN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Fold one source's selected rows for token t into the online-softmax state (m, denom, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    n = num_idx
    if HAS_LEN:
        n = tl.minimum(tl.load(Len + t).to(tl.int32), num_idx)
    idx_row = Idx + t.to(tl.int64) * stride_it
    for k0 in range(0, n, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + cols, mask=cols < n, other=-1).to(tl.int64)
        valid = idx >= 0
        rows = tl.load(
            KV + idx[:, None] * stride_kv + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
        )
        rows_op = dot_operand(rows, DOT_F32)
        s = tl.dot(q, tl.trans(rows_op), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        pv = tl.dot(dot_operand(p.to(rows.dtype), DOT_F32), rows_op, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, denom, acc


@triton.jit
def _sparse_attention(
    Q, KV, Idx, Len, KV2, Idx2, Len2, Sinks, Out,
    qk_scale, num_idx, num_idx2,
    stride_qt, stride_qh, stride_kv, stride_it, stride_kv2, stride_it2, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr,
    HAS_LEN2: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    head_blocks = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    t = tl.program_id(0) // head_blocks  # a token's head blocks run side by side: its rows stay in L2
    heads = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < NUM_HEADS
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = mask_h[:, None] & (offs_d < D)[None, :]
    q = tl.load(
        Q + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_hd, other=0.0
    )
    q = dot_operand(q, DOT_F32)
    if HAS_SINK:  # the sink as a first key of value zero: max = sink, denominator = exp2(0)
        m = tl.load(Sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
        denom = tl.full([BLOCK_H], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite, so exp2(m - m_new) is 1 or 0, never NaN
        denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m, denom, acc = _attend_source(
        m, denom, acc, q, KV, Idx, Len, t, num_idx, stride_kv, stride_it, qk_scale,
        HAS_LEN, D, BLOCK_D, BLOCK_N, DOT_PREC, DOT_F32,
    )  # fmt: skip
    if HAS_EXTRA:
        m, denom, acc = _attend_source(
            m, denom, acc, q, KV2, Idx2, Len2, t, num_idx2, stride_kv2, stride_it2, qk_scale,
            HAS_LEN2, D, BLOCK_D, BLOCK_N, DOT_PREC, DOT_F32,
        )  # fmt: skip
    o = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]  # no row, no sink: acc = 0, out 0
    out_ptrs = Out + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=mask_hd)


def _source(kv: torch.Tensor, indices: torch.Tensor, length: torch.Tensor | None, tokens: int, dim: int):
    kv, idx = rows_2d(kv), indices_2d(indices)
    assert kv.shape[-1] == dim and kv.stride(-1) == 1, (kv.shape, dim)
    assert idx.shape[0] == tokens and idx.dtype in (torch.int32, torch.int64), (idx.shape, idx.dtype)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    return kv, idx, length


def sparse_attention(
    q, kv, indices, sinks, scale, topk_length=None, extra_kv=None, extra_indices=None, extra_topk_length=None,
    out=None,
):  # fmt: skip
    """`SparseAttention`."""
    tokens, num_heads, dim = q.shape
    assert q.stride(-1) == 1
    out = q.new_empty(tokens, num_heads, dim) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    kv, idx, length = _source(kv, indices, topk_length, tokens, dim)
    extra = extra_kv is not None
    kv2, idx2, length2 = _source(extra_kv, extra_indices, extra_topk_length, tokens, dim) if extra else (
        kv, idx, length
    )  # fmt: skip
    if tokens == 0:
        return out
    cfg = default_config(num_heads, dim, q.dtype, q.device)
    block_h = max(16, min(cfg.block_h, next_pow2(num_heads)))
    sinks_arg = sinks if sinks is not None else q  # unused without HAS_SINK
    grid = (tokens * -(-num_heads // block_h),)
    _sparse_attention[grid](
        q, kv, idx, length if length is not None else idx, kv2, idx2,
        length2 if length2 is not None else idx2, sinks_arg, out,
        scale * LOG2E, idx.shape[1], idx2.shape[1],
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), kv2.stride(0), idx2.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, D=dim, BLOCK_D=max(16, next_pow2(dim)), BLOCK_H=block_h,
        BLOCK_N=cfg.block_n, HAS_SINK=sinks is not None, HAS_LEN=length is not None, HAS_EXTRA=extra,
        HAS_LEN2=extra and length2 is not None, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out

"""MLA prefill (expanded form) in Triton, flash-attention style over ragged rows of contiguous K/V.

One program per (block of BLOCK_M queries, row, head); the grid's first axis runs the query blocks last
to first, so the blocks that see the most keys start first. Keys before the block's first query
position are visible to all its queries and are read without any mask; only the blocks on the diagonal
(and the row's end) are masked. Online softmax in float32 with the base-2 exponent (the scale is
folded with log2 e). d_qk need not be a power of two (192 = 128 + 64 for DeepSeek): q and k are read
as two column parts, each a power of two (the second padded and masked), and the scores are the sum of
two dots; d_v is padded to a power of two with a mask. bf16/fp16 dots accumulate in float32; float32
inputs get exact (ieee) dots."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, dot_precision, next_pow2
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # queries per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


# Untuned guesses, not measured on the device yet: the usual Hopper flash-attention forward shape for
# 16-bit inputs (a 128 x 192 q tile, 64-key K/V tiles, two stages: ~130 KB shared memory at d_qk 192);
# float32 tiles take twice the bytes, so smaller blocks; the interpreter only wants small grids.
CONFIG_16BIT = PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
CONFIG_FP32 = PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
CONFIG_CPU = PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def default_config(dtype: torch.dtype, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":
        return CONFIG_CPU
    return CONFIG_FP32 if dtype == torch.float32 else CONFIG_16BIT


def split_dim(d: int) -> tuple[int, int, int]:
    """d_qk as (part A, its block, part B's block): A the largest power of two <= d (at least 16, the
    smallest dot), B = d - A padded to a power of two >= 16 (0: no part B)."""
    if d <= 16 or d & (d - 1) == 0:
        return d, max(16, next_pow2(d)), 0
    a = 1 << (d.bit_length() - 1)
    return a, a, max(16, next_pow2(d - a))


@triton.jit
def _load(ptrs, rows_ok, cols, D: tl.constexpr, BLOCK: tl.constexpr, ROW_MASK: tl.constexpr):
    """A [rows, BLOCK] tile whose columns past D (and, with ROW_MASK, rows not ok) read as 0."""
    if ROW_MASK:
        if BLOCK == D:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (cols < D)[None, :], other=0.0)
    else:
        if BLOCK == D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=(cols < D)[None, :], other=0.0)
    return x


@triton.jit
def _step(
    acc, m_i, l_i, q_a, q_b, k_base, v_base, s0, q_pos, end, stride_kt, stride_vt, qk_scale,
    D_A: tl.constexpr, D_B: tl.constexpr, D_V: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    """One block of BLOCK_N keys from s0 into the running (acc, max, denominator). MASKED: the block
    may hold keys past `end` or after a query's position (the diagonal)."""
    pos = s0 + tl.arange(0, BLOCK_N)
    ok = pos < end
    k_rows = k_base + pos.to(tl.int64)[:, None] * stride_kt
    offs_a = tl.arange(0, BLOCK_A)
    k_a = dot_operand(_load(k_rows + offs_a[None, :], ok, offs_a, D_A, BLOCK_A, MASKED), DOT_F32)
    qk = tl.dot(q_a, tl.trans(k_a), input_precision=DOT_PREC)
    if D_B > 0:
        offs_b = tl.arange(0, BLOCK_B)
        k_b = dot_operand(_load(k_rows + D_A + offs_b[None, :], ok, offs_b, D_B, BLOCK_B, MASKED), DOT_F32)
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision=DOT_PREC)
    qk = qk * qk_scale
    if MASKED:  # the first key of every masked loop is visible to every query: no all -inf first row
        qk = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    offs_v = tl.arange(0, BLOCK_V)
    v_ptrs = v_base + pos.to(tl.int64)[:, None] * stride_vt + offs_v[None, :]
    v = _load(v_ptrs, ok, offs_v, D_V, BLOCK_V, MASKED)
    pv = tl.dot(dot_operand(p.to(v.dtype), DOT_F32), dot_operand(v, DOT_F32), input_precision=DOT_PREC)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _mla_prefill(
    Q, K, V, Out, QStarts, QLens, KvStarts, KvLens,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    D_A: tl.constexpr, D_B: tl.constexpr, D_V: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest) query blocks first
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(QLens + b).to(tl.int32)
    if mb * BLOCK_M < q_len:
        prefix = tl.load(KvLens + b).to(tl.int32) - q_len
        q_start = tl.load(QStarts + b).to(tl.int64)
        kv_start = tl.load(KvStarts + b).to(tl.int64)

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q_pos = prefix + offs_m
        q_rows = Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh
        offs_a = tl.arange(0, BLOCK_A)
        q_a = dot_operand(_load(q_rows + offs_a[None, :], m_ok, offs_a, D_A, BLOCK_A, True), DOT_F32)
        if D_B > 0:
            offs_b = tl.arange(0, BLOCK_B)
            q_b = dot_operand(
                _load(q_rows + D_A + offs_b[None, :], m_ok, offs_b, D_B, BLOCK_B, True), DOT_F32
            )
        else:
            q_b = q_a  # unused

        k_base = K + kv_start * stride_kt + h * stride_kh
        v_base = V + kv_start * stride_vt + h * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        first = prefix + mb * BLOCK_M  # every key before the block's first query is visible to all of it
        unmasked_end = (first // BLOCK_N) * BLOCK_N
        end = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)  # keys the block's last query sees
        for s0 in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _step(
                acc, m_i, l_i, q_a, q_b, k_base, v_base, s0, q_pos, end, stride_kt, stride_vt, qk_scale,
                D_A, D_B, D_V, BLOCK_A, BLOCK_B, BLOCK_V, BLOCK_N, False, DOT_PREC, DOT_F32,
            )  # fmt: skip
        for s0 in range(unmasked_end, end, BLOCK_N):
            acc, m_i, l_i = _step(
                acc, m_i, l_i, q_a, q_b, k_base, v_base, s0, q_pos, end, stride_kt, stride_vt, qk_scale,
                D_A, D_B, D_V, BLOCK_A, BLOCK_B, BLOCK_V, BLOCK_N, True, DOT_PREC, DOT_F32,
            )  # fmt: skip

        o = acc / l_i[:, None]
        offs_v = tl.arange(0, BLOCK_V)
        o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=m_ok[:, None] & (offs_v < D_V)[None, :])


def mla_prefill(q, k, v, q_starts, q_lens, kv_starts, kv_lens, scale, max_q_len=None, out=None):
    """`MlaPrefill`."""
    num_tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    assert k.shape[1:] == (heads, d_qk) and v.shape[:2] == k.shape[:2], (q.shape, k.shape, v.shape)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    out = q.new_empty(num_tokens, heads, d_v) if out is None else out
    assert out.shape == (num_tokens, heads, d_v) and out.stride(2) == 1
    batch = q_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    max_q_len = num_tokens if max_q_len is None else max_q_len
    cfg = default_config(q.dtype, q.device)
    d_a, block_a, block_b = split_dim(d_qk)
    grid = (triton.cdiv(max_q_len, cfg.block_m), batch, heads)
    _mla_prefill[grid](
        q, k, v, out, q_starts, q_lens, kv_starts, kv_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        D_A=d_a, D_B=d_qk - d_a, D_V=d_v, BLOCK_A=block_a, BLOCK_B=max(block_b, 16),
        BLOCK_V=max(16, next_pow2(d_v)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out

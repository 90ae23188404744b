"""Extend (prefill with a cached prefix) attention in Triton, flash-attention style over the paged cache.

One program per (row, q head, block of BLOCK_M new tokens). The new tokens' K/V are already in the pool,
so every key, prefix or new, is read through req_to_token[row, pos] (any page size works); the causal
rule is one comparison, key position <= query position. A decode row is simply a row of one token, so
mixed batches need no special case. Online softmax in float32.

`prefill_attention` is the same attention with the new keys read from the step's own k/v in 16-bit (the
qkv projection's output, rotated in place as it is stored): dense rows rather than gathered through the
page table and upcast from an fp8 pool. Only a cached prefix, if any, is gathered from the pools. The
new key blocks left of a query block's diagonal need no mask; only the diagonal blocks compare
positions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, dot_precision, next_pow2
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@triton.jit
def _softmax_step(acc, m, denom, q, k, v, visible, qk_scale,
                  DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One key block of online softmax; MASKED: only the keys `visible` ([M, N] or [1, N]) count."""
    qk = tl.dot(q, tl.trans(dot_operand(k, DOT_F32)), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    pv = tl.dot(dot_operand(p.to(v.dtype), DOT_F32), dot_operand(v, DOT_F32), input_precision=DOT_PREC)
    return acc * alpha[:, None] + pv, m_new, denom


@triton.jit
def _extend(
    Q, K, V, Out, ReqToToken, Rows, PrefixLens, ExtendLens, QStarts,
    qk_scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    mb = tl.program_id(0)  # block of new tokens first: long rows' blocks spread over the grid
    b = tl.program_id(1)
    h = tl.program_id(2)
    ext = tl.load(ExtendLens + b).to(tl.int32)
    if mb * BLOCK_M < ext:
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        q_start = tl.load(QStarts + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        kvh = h // GROUP

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        tok = q_start + offs_m
        q_ptrs = Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = dot_operand(tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0), DOT_F32)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = prefix + tl.minimum(ext, (mb + 1) * BLOCK_M)  # keys the block's last query sees
        slot_row = ReqToToken + row * stride_rt
        for s0 in range(0, end, BLOCK_N):
            pos = s0 + tl.arange(0, BLOCK_N)
            mask_n = pos < end
            slot = tl.load(slot_row + pos, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(
                K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(Q.dtype.element_ty)  # an fp8 KV pool is upcast to q's dtype
            v = tl.load(
                V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(Q.dtype.element_ty)
            # every query sees key 0, so no row of the first block is all -inf (no NaN)
            visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
            acc, m, denom = _softmax_step(acc, m, denom, q, k, v, visible, qk_scale, DOT_PREC, DOT_F32, True)

        o = acc / denom[:, None]
        o_ptrs = Out + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# (BLOCK_M, BLOCK_N, warps, stages) for 16-bit queries of head dim <= 128; float32 or wider heads take
# (32, 32, 4, 2), their tiles being twice the shared memory
LAUNCH = (64, 64, 4, 2)


def extend_attention(
    q, k_pool, v_pool, req_to_token, rows, prefix_lens, extend_lens, q_starts, scale, max_extend=None,
    out=None,
):  # fmt: skip
    """`ExtendAttention`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    assert num_q_heads % num_kv_heads == 0 and q.stride(2) == 1 and k_pool.stride(2) == 1
    assert v_pool.stride(2) == 1 and req_to_token.stride(1) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.stride(2) == 1
    batch = rows.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    max_extend = num_tokens if max_extend is None else max_extend
    block_d = next_pow2(head_dim)
    if q.dtype == torch.float32 or block_d > 128:
        block_m, block_n, warps, stages = 32, 32, 4, 2
    else:
        block_m, block_n, warps, stages = LAUNCH
    grid = (triton.cdiv(max_extend, block_m), batch, num_q_heads)
    _extend[grid](
        q, k_pool, v_pool, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _prefill(
    Q, K, V, Out, QStarts, Lens, KPool, VPool, ReqToToken, Rows, PrefixLens,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_ks, stride_kph, stride_vs, stride_vph, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    n = tl.load(Lens + b).to(tl.int32)
    if mb * BLOCK_M < n:
        start = tl.load(QStarts + b).to(tl.int64)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # new-token index within the row
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = dot_operand(tl.load(q_ptrs, mask=(offs_m < n)[:, None], other=0.0), DOT_F32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if HAS_PREFIX:
            # the cached prefix, gathered from the pools: every key visible to every query
            prefix = tl.load(PrefixLens + b).to(tl.int32)
            slot_row = ReqToToken + tl.load(Rows + b).to(tl.int64) * stride_rt
            for s0 in range(0, prefix, BLOCK_N):
                pos = s0 + tl.arange(0, BLOCK_N)
                inside = pos < prefix
                slot = tl.load(slot_row + pos, mask=inside, other=0).to(tl.int64)
                k = tl.load(KPool + slot[:, None] * stride_ks + kvh * stride_kph + offs_d[None, :],
                            mask=inside[:, None], other=0.0).to(Q.dtype.element_ty)  # fmt: skip
                v = tl.load(VPool + slot[:, None] * stride_vs + kvh * stride_vph + offs_d[None, :],
                            mask=inside[:, None], other=0.0).to(Q.dtype.element_ty)  # fmt: skip
                acc, m, denom = _softmax_step(
                    acc, m, denom, q, k, v, inside[None, :], qk_scale, DOT_PREC, DOT_F32, True
                )  # fmt: skip
        # the new keys, dense: those left of the block's first query are visible to every query
        k_base = K + start * stride_kt + kvh * stride_kh + offs_d[None, :]
        v_base = V + start * stride_vt + kvh * stride_vh + offs_d[None, :]
        diag = mb * BLOCK_M
        for s0 in range(0, diag, BLOCK_N):
            offs_n = s0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_kt)
            v = tl.load(v_base + offs_n[:, None] * stride_vt)
            acc, m, denom = _softmax_step(acc, m, denom, q, k, v, None, qk_scale, DOT_PREC, DOT_F32, False)
        # the diagonal blocks: new key `diag` is visible to every query of the block, so no row is all -inf
        for s0 in range(diag, tl.minimum(diag + BLOCK_M, n), BLOCK_N):
            offs_n = s0 + tl.arange(0, BLOCK_N)
            inside = offs_n < n
            k = tl.load(k_base + offs_n[:, None] * stride_kt, mask=inside[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vt, mask=inside[:, None], other=0.0)
            visible = inside[None, :] & (offs_n[None, :] <= offs_m[:, None])
            acc, m, denom = _softmax_step(acc, m, denom, q, k, v, visible, qk_scale, DOT_PREC, DOT_F32, True)
        o = acc / denom[:, None]
        o_ptrs = Out + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=(offs_m < n)[:, None])


# (BLOCK_M, BLOCK_N, warps, stages) for 16-bit queries, by the longest row; BLOCK_M must be a multiple of
# BLOCK_N. Measured on the H200 at Llama-8B heads (docs/PERF.md): 16 rows of 1000 tokens 426 us with
# 64-token query blocks against 467 with 128; one row of 16000 tokens 4.52 ms with 128 against 4.80.
PREFILL_LAUNCH = {"short": (64, 64, 4, 3), "long": (128, 64, 8, 3)}
PREFILL_LONG_ROW = 2048


def prefill_attention(q, k, v, q_starts, lens, scale, max_len=None, out=None, cached=None):
    """`PrefillAttention`; the new keys dense from k and v, a cached prefix gathered from the pools."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_q_heads % num_kv_heads == 0 and head_dim == next_pow2(head_dim)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k.dtype == q.dtype == v.dtype
    out = torch.empty_like(q) if out is None else out
    assert out.stride(2) == 1
    batch = lens.shape[0]
    max_len = num_tokens if max_len is None else max_len
    if batch == 0 or max_len == 0:  # nothing to attend (an empty grid is not a launch)
        return out
    if cached is None:  # no pools to read: any tensors fill their slots in the launch (a table whose
        # row stride does not change with the batch: Triton specialises ints, and len(lens) as the
        # stride compiled a new variant mid-run whenever the count of rows went past 1 or 16)
        k_pool, v_pool, r2t, rows, prefix_lens = k, v, lens.view(-1, 1), lens, lens
    else:
        k_pool, v_pool, r2t, rows, prefix_lens = cached
        assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and r2t.stride(1) == 1
    if q.dtype == torch.float32 or head_dim > 128:
        block_m, block_n, warps, stages = 32, 32, 4, 2
    else:
        block_m, block_n, warps, stages = PREFILL_LAUNCH["long" if max_len > PREFILL_LONG_ROW else "short"]
    grid = (triton.cdiv(max_len, block_m), batch, num_q_heads)
    _prefill[grid](
        q, k, v, out, q_starts, lens, k_pool, v_pool, r2t, rows, prefix_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), r2t.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_PREFIX=cached is not None, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out

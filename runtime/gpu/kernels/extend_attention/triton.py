"""Extend (prefill with a cached prefix) attention in Triton, flash-attention style over the paged cache.

One program per (row, q head, block of BLOCK_M new tokens). The new tokens' K/V are already in the pool,
so every key, prefix or new, is read through req_to_token[row, pos] (any page size works); the causal
rule is one comparison, key position <= query position. A decode row is simply a row of one token, so
mixed batches need no special case. Online softmax in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, dot_precision, next_pow2
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


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
            qk = tl.dot(q, tl.trans(dot_operand(k, DOT_F32)), input_precision=DOT_PREC) * qk_scale
            # every query sees key 0, so no row of the first block is all -inf (no NaN)
            qk = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(
                V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
            ).to(Q.dtype.element_ty)
            pv = tl.dot(
                dot_operand(p.to(v.dtype), DOT_F32), dot_operand(v, DOT_F32), input_precision=DOT_PREC
            )
            acc = acc * alpha[:, None] + pv
            m = m_new

        o = acc / denom[:, None]
        o_ptrs = Out + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(
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
    """Same contract as `reference.extend_attention`. `max_extend` (the longest row's new tokens, known
    on the host) sizes the grid; None uses all of q's tokens (correct, some programs idle)."""
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
    if q.dtype == torch.float32 or block_d > 128:  # fp32 tiles take twice the shared memory
        block_m, block_n, warps = 32, 32, 4
    else:
        block_m, block_n, warps = 64, 64, 4
    grid = (triton.cdiv(max_extend, block_m), batch, num_q_heads)
    _extend[grid](
        q, k_pool, v_pool, out, req_to_token, rows, prefix_lens, extend_lens, q_starts,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out

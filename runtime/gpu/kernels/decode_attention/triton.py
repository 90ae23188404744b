"""Paged decode attention in Triton, flash-decoding style.

Stage 1: one program per (row, kv head, KV split) walks its part of the row's slots (looked up per token
in req_to_token, so any page size works), for all the q heads that share the kv head at once (GQA: one
read of K/V serves the group), and writes a normalised partial output and its log-sum-exp (base 2).
Stage 2: one program per (row, q head) merges the splits. All accumulation is in float32.

Verify steps (speculative decoding) have Q_LEN > 1 query tokens per row, the row's last Q_LEN positions:
they join the GQA group's heads in one tile (Q_LEN * GROUP query rows per kv head), each masked to the
keys up to its own position, so the row's K/V is still read once per step."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, choose_num_splits, dot_precision, next_pow2
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand

# (KV tokens per inner step, warps, pipeline stages) by the KV pool's bytes per value. 16-bit: swept on
# the H200, 4 stages 20-22% faster than 2 at B=64-256, 1K-4K contexts (docs/PERF.md). An fp8 pool
# (--kv-cache-dtype fp8_e4m3) moves half the bytes per token: a step covers more tokens for the same tile;
# with PREFETCH_SLOTS, 3 stages were the best of 2-4 (BLOCK_N 256 and 8 warps lost; docs/PERF.md).
LAUNCH = {4: (64, 4, 4), 2: (64, 4, 4), 1: (128, 4, 3)}

# An fp8 (e4m3) pool's values reach the tensor cores as float16 (`cvt.rn.f16x2.e4m3x2`, two values per
# instruction; KV_MODE 1); q and p go to float16 too (|q| and p are far inside float16's range),
# accumulation stays float32: 227.2 us per layer at B=256, 1K on the H200. Timed and dropped
# (docs/PERF.md): an upcast to q's dtype (248.8 us: no one-instruction e4m3 -> bf16 conversion), moving
# the e4m3 bits into a float16 with integer ops (308.5 us), and K q^T with the converted K tile as the
# register operand (245.3 us). 16-bit pools load in q's dtype (KV_MODE 0).

# Load the next step's slot numbers while this step's tiles are in flight, by the pool's bytes per value.
# Without it Triton's pipeliner waits for a step's own slot load before issuing its K/V gather and keeps
# a single K/V buffer. fp8 pools, on the H200: 226.4 -> 214.3 us per layer at B=256, 1K and 214.2 ->
# 189.6 us at B=64, 4K (docs/PERF.md); 16-bit pools gained nothing (within 1%), so they keep the
# simpler loop.
PREFETCH_SLOTS = {4: False, 2: False, 1: True}


@triton.jit
def _kv_tile(ptrs, mask, KV_MODE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of the pool as a dot operand: 1, an e4m3 pool's, as float16; 0, in q's
    dtype (a no-op cast for 16-bit pools)."""
    if KV_MODE == 1:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float16)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(OUT_DTYPE)


@triton.jit
def _stage1(
    Q, K, V, ReqToToken, Rows, SeqLens, MidO, MidLse,
    qk_scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, KV_MODE: tl.constexpr,
    PREFETCH: tl.constexpr, Q_LEN: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_q_heads = tl.num_programs(1) * GROUP

    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    per_split = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # query rows of the tile: (position, head of the group)
    mask_h = offs_h < Q_LEN * GROUP
    heads = kvh * GROUP + offs_h % GROUP
    token = b * Q_LEN + offs_h // GROUP  # the query's token in q
    limit = seq_len - Q_LEN + 1 + offs_h // GROUP  # keys it sees: positions < limit
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + token[:, None].to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if KV_MODE != 0:
        q = q.to(tl.float16)
    q = dot_operand(q, DOT_F32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    slot_row = ReqToToken + row * stride_rt
    if PREFETCH:
        first = start + tl.arange(0, BLOCK_N)
        slot_next = tl.load(slot_row + first, mask=first < end, other=0).to(tl.int64)
    for s0 in range(start, end, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        if PREFETCH:
            slot = slot_next
            ahead = pos + BLOCK_N
            slot_next = tl.load(slot_row + ahead, mask=ahead < end, other=0).to(tl.int64)
        else:
            slot = tl.load(slot_row + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = _kv_tile(
            K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
            kv_mask,
            KV_MODE,
            Q.dtype.element_ty,
        )
        qk = (
            tl.dot(q, tl.trans(dot_operand(k, DOT_F32)), input_precision=DOT_PREC) * qk_scale
        )  # [BLOCK_H, BLOCK_N], base 2
        if Q_LEN == 1:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_use = m_new
        else:  # causal inside the row's new tokens; a query may see no key of this tile yet
            qk = tl.where(mask_n[None, :] & (pos[None, :] < limit[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(qk - m_use[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = _kv_tile(
            V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
            kv_mask,
            KV_MODE,
            Q.dtype.element_ty,
        )
        acc = acc * alpha[:, None] + tl.dot(
            dot_operand(p.to(v.dtype), DOT_F32), dot_operand(v, DOT_F32), input_precision=DOT_PREC
        )
        m = m_new

    has = denom > 0.0  # an empty split (short row) leaves denom = 0: lse = -inf, ignored by stage 2
    lse = tl.where(has, m + tl.log2(tl.where(has, denom, 1.0)), float("-inf"))
    o = acc / tl.where(has, denom, 1.0)[:, None]
    mid = (token * num_q_heads + heads).to(tl.int64) * num_splits + split  # [BLOCK_H]
    keep = mask_h & (start + 0 * offs_h < seq_len)  # splits past the row's end: never read by stage 2
    tl.store(MidLse + mid, lse, mask=keep)
    tl.store(MidO + mid[:, None] * HEAD_DIM + offs_d[None, :], o, mask=keep[:, None] & mask_d[None, :])


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of a row: whole BLOCK_N steps, so a short row under a graph's fixed split count
    uses only its first few splits (the rest exit at once and stage 2 skips them)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _stage2(
    MidO, MidLse, Out, SeqLens, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_LEN: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)  # the query token (row b // Q_LEN)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b // Q_LEN).to(tl.int32)
    used = tl.cdiv(seq_len, tl.maximum(_split_len(seq_len, num_splits, BLOCK_N), 1))
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < tl.minimum(used, num_splits)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits + offs_s
    lse = tl.load(MidLse + base, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(mask_s & (lse > float("-inf")), w, 0.0)
    o = tl.load(
        MidO + base[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def stage1(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    q_len: int = 1,
):
    """Launch stage 1: (partial outputs [T, Hq, splits, D] f32, their lse [T, Hq, splits] f32, and
    Triton's compiled kernel, whose `asm` / `n_regs` / `metadata.shared` `benchmarks.kernels.decode_attention_sweep --compiled` prints).
    T = B * q_len query tokens."""
    tokens, num_q_heads, head_dim = q.shape
    batch = tokens // q_len
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    block_n, num_warps, num_stages = LAUNCH[k_pool.element_size()]
    kv_mode = 1 if k_pool.dtype == torch.float8_e4m3fn and q.dtype != torch.float32 else 0
    mid_o = torch.empty(tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    compiled = _stage1[(batch, num_kv_heads, num_splits)](
        q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_H=max(16, next_pow2(q_len * group)),
        BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), KV_MODE=kv_mode,
        PREFETCH=PREFETCH_SLOTS[k_pool.element_size()], Q_LEN=q_len, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return mid_o, mid_lse, compiled


def decode_attention(
    q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_splits=None, out=None, page_size=1, q_len=1
):
    """`DecodeAttention`. Slots are looked up per token, so `page_size` changes nothing here."""
    assert q.shape[1] % k_pool.shape[1] == 0 and q.stride(2) == 1 and k_pool.stride(2) == 1
    assert v_pool.stride(2) == 1 and req_to_token.stride(1) == 1 and q.shape[0] == rows.shape[0] * q_len
    args = (q, k_pool, v_pool, req_to_token, rows, seq_lens, scale)
    if q_len == 1:
        return split_kv(stage1, LAUNCH[k_pool.element_size()][0], *args, num_splits, out)
    return split_kv(
        functools.partial(stage1, q_len=q_len),
        LAUNCH[k_pool.element_size()][0],
        *args,
        num_splits,
        out,
        q_len=q_len,
    )


def split_kv(
    stage1_fn: Callable[..., tuple],
    block_n: int,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    out: torch.Tensor | None,
    direct: bool = False,
    q_len: int = 1,
) -> torch.Tensor:
    """Flash-decoding around a stage 1 (this module's or `tilelang.stage1`, whose splits are multiples
    of `block_n`): the output buffer, the split count when not given (from the batch and req_to_token's
    width, an upper bound on lengths, so no sync), then stage 2. `direct`: stage1_fn takes `out=` and,
    with one split, writes the output itself (dense heads), so stage 2 does not run."""
    out = torch.empty_like(q) if out is None else out
    assert out.stride(2) == 1
    if q.shape[0] == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(rows.shape[0], k_pool.shape[1], req_to_token.shape[1], q.device)
    args = (q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_splits)
    if direct and num_splits == 1 and out.stride(1) == q.shape[2]:
        # the merge would only copy: skipping it saves a launch and 8 us a layer at B=256 (docs/PERF.md)
        stage1_fn(*args, out=out)
        return out
    mid_o, mid_lse = stage1_fn(*args)[:2]
    return merge_splits(mid_o, mid_lse, seq_lens, out, block_n, q_len)


def merge_splits(
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    block_n: int,
    q_len: int = 1,
) -> torch.Tensor:
    """Stage 2: `out` [T, Hq, D] from stage 1's partials, whose splits are multiples of `block_n`
    (T = rows * q_len query tokens)."""
    batch, num_q_heads, num_splits, head_dim = mid_o.shape
    _stage2[(batch, num_q_heads)](
        mid_o, mid_lse, out, seq_lens, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_S=max(2, next_pow2(num_splits)),
        BLOCK_N=block_n, Q_LEN=q_len, num_warps=4,
    )  # fmt: skip
    return out

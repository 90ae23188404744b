"""MLA decode (absorbed, DeepSeek-V2/V3) on the paged latent cache in Triton, flash-decoding style.

Stage 1: one program per (row, block of BLOCK_H q heads, KV split) walks its share of the row's tokens,
BLOCK_N at a time. A KV block is loaded once as [BLOCK_N, kv_lora_rank] + [BLOCK_N, rope] and serves
every head of the block twice: as keys (`q_nope . c + q_pe . k_pe`) and, its first kv_lora_rank dims,
as values (no second read). Online softmax in float32 (base 2). With one split the program normalises and
writes the output (and LSE) itself; otherwise it writes a normalised partial and its LSE and stage 2
(one program per (row, head)) merges the splits.

Token -> slot goes through a block table: `slot = table[row, pos // PAGE] * PAGE + pos % PAGE`.
`req_to_token` is the PAGE = 1 case (the engine's layout, any page size); a FlashMLA block table
(`block_table[b, i]` = page of tokens i*64 .. i*64+63) is PAGE = 64, so the FlashMLA-signature adapter
(`api.py`) runs the same kernel without building a per-token table.

Verify steps (Q_LEN > 1 query tokens per row, its last Q_LEN positions) extend the heads: virtual head
v is head v % NUM_HEADS of the row's token v // NUM_HEADS, masked to the keys up to its position, so the
head blocks of one row still share its KV blocks (through L2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import LOG2E, choose_num_splits, dot_precision, next_pow2
from runtime.gpu.kernels.mla_decode.reference import pool_2d
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand

LN2 = 0.6931471805599453


@dataclass(frozen=True)
class MLAConfig:
    block_h: int = 16  # q heads per program (the KV block is read once per head block)
    block_n: int = 32  # KV tokens per inner step
    num_warps: int = 4
    num_stages: int = 2


def default_config(num_heads: int, device: torch.device) -> MLAConfig:
    """Fixed guesses, not tuned on the device (SGLang's grouped Triton MLA kernel uses 16 x 32, 4 warps,
    2 stages on Hopper); on Hopper the TileLang kernel runs instead."""
    if device.type != "cuda":
        return MLAConfig(block_h=16, block_n=16, num_warps=1, num_stages=1)
    return MLAConfig()


@triton.jit
def _stage1(
    Q, KV, Table, Rows, SeqLens, MidO, MidLse, Out, Lse,
    qk_scale,
    stride_qb, stride_qh, stride_kv, stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, D_V: tl.constexpr, D_PE: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    Q_LEN: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    virtual = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # (the row's token, head)
    mask_h = virtual < Q_LEN * NUM_HEADS
    heads = virtual % NUM_HEADS
    token = b * Q_LEN + virtual // NUM_HEADS
    limit = seq_len - Q_LEN + 1 + virtual // NUM_HEADS  # keys the query sees: positions < limit
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < D_V
    offs_pe = tl.arange(0, BLOCK_DPE)
    mask_pe = offs_pe < D_PE
    q_row = Q + token[:, None].to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_dv[None, :], mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    q_pe = tl.load(q_row + D_V + offs_pe[None, :], mask=mask_h[:, None] & mask_pe[None, :], other=0.0)
    q_nope = dot_operand(q_nope, DOT_F32)
    q_pe = dot_operand(q_pe, DOT_F32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    table_row = Table + row * stride_tb
    for s0 in range(start, end, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        if PAGE == 1:
            slot = tl.load(table_row + pos, mask=mask_n, other=0).to(tl.int64)
        else:
            page = tl.load(table_row + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
        kv_row = KV + slot[:, None] * stride_kv
        # an e4m3 pool (--kv-cache-dtype fp8_e4m3, scale 1) is upcast to q's dtype as it is loaded
        c = tl.load(kv_row + offs_dv[None, :], mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        c = c.to(Q.dtype.element_ty)
        k_pe = tl.load(kv_row + D_V + offs_pe[None, :], mask=mask_n[:, None] & mask_pe[None, :], other=0.0)
        k_pe = k_pe.to(Q.dtype.element_ty)
        c_op = dot_operand(c, DOT_F32)
        qk = tl.dot(q_nope, tl.trans(c_op), input_precision=DOT_PREC)
        qk += tl.dot(q_pe, tl.trans(dot_operand(k_pe, DOT_F32)), input_precision=DOT_PREC)
        if Q_LEN == 1:
            qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], base 2
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_use = m_new
        else:  # causal among the row's new tokens; a query may see no key of this block yet
            seen = mask_n[None, :] & (pos[None, :] < limit[:, None])
            qk = tl.where(seen, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(qk - m_use[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            dot_operand(p.to(c.dtype), DOT_F32), c_op, input_precision=DOT_PREC
        )
        m = m_new

    has = denom > 0.0  # an empty split (short row) leaves denom = 0: lse = -inf, ignored by stage 2
    lse = tl.where(has, m + tl.log2(tl.where(has, denom, 1.0)), float("-inf"))
    o = acc / tl.where(has, denom, 1.0)[:, None]
    if DIRECT:  # one split: this is the answer
        out_ptrs = (
            Out + token[:, None].to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
        )
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(Lse + token * NUM_HEADS + heads, lse * 0.6931471805599453, mask=mask_h)
    else:
        mid = (token * NUM_HEADS + heads).to(tl.int64) * num_splits + split  # [BLOCK_H]
        tl.store(MidLse + mid, lse, mask=mask_h)
        tl.store(MidO + mid[:, None] * D_V + offs_dv[None, :], o, mask=mask_h[:, None] & mask_dv[None, :])


@triton.jit
def _stage2(
    MidO, MidLse, Out, Lse, num_splits, stride_ob, stride_oh,
    D_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < D_V
    bh = b * tl.num_programs(1) + h
    base = bh.to(tl.int64) * num_splits + offs_s
    lse = tl.load(MidLse + base, mask=mask_s, other=float("-inf"))
    top = tl.max(lse, 0)
    ok = mask_s & (lse > float("-inf"))
    w = tl.where(ok, tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    o = tl.load(
        MidO + base[:, None] * D_V + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )
    row_lse = tl.where(total > 0.0, top + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(Lse + bh, row_lse * 0.6931471805599453)


def mla_decode_paged(
    q: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    page: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    q_len: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher. q [B * q_len, Hq, D] (last stride 1); pool [slots, D]; table [rows, width]
    (int32/64) maps token pos of a row to `table[row, pos // page] * page + pos % page`. Returns
    (out [B * q_len, Hq, r] in q's dtype, lse [B * q_len, Hq] float32 natural log)."""
    tokens, num_heads, dim = q.shape
    batch = rows.shape[0]
    assert tokens == batch * q_len, (q.shape, rows.shape, q_len)
    d_pe = dim - kv_lora_rank
    assert d_pe >= 0 and pool.shape[-1] == dim, (q.shape, pool.shape, kv_lora_rank)
    assert q.stride(2) == 1 and pool.stride(-1) == 1 and table.stride(-1) == 1
    out = q.new_empty(tokens, num_heads, kv_lora_rank) if out is None else out
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.stride(2) == 1 and lse.is_contiguous()
    if batch == 0:
        return out, lse
    cfg = default_config(num_heads, q.device)
    block_h = max(16, min(cfg.block_h, next_pow2(num_heads * q_len)))
    head_blocks = -(-num_heads * q_len // block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, table.shape[1] * page, q.device)
    direct = num_splits == 1
    block_dv, block_dpe = next_pow2(kv_lora_rank), max(16, next_pow2(max(d_pe, 1)))
    if direct:
        mid_o = mid_lse = lse  # unused
    else:
        mid_o = torch.empty(tokens, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _stage1[(batch, head_blocks, num_splits)](
        q, pool, table, rows, seq_lens, mid_o, mid_lse, out, lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), pool.stride(0), table.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, D_V=kv_lora_rank, D_PE=d_pe, BLOCK_DV=block_dv, BLOCK_DPE=block_dpe,
        BLOCK_H=block_h, BLOCK_N=cfg.block_n, PAGE=page, DIRECT=direct,
        DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q), Q_LEN=q_len, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if not direct:
        _stage2[(tokens, num_heads)](
            mid_o, mid_lse, out, lse, num_splits, out.stride(0), out.stride(1),
            D_V=kv_lora_rank, BLOCK_DV=block_dv, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=4,
        )  # fmt: skip
    return out, lse


def mla_decode(
    q, latent_pool, req_to_token, rows, seq_lens, scale, kv_lora_rank=512, num_splits=None, out=None,
    return_lse=False, page_size=1, q_len=1,
):  # fmt: skip
    """`MlaDecode`."""
    o, lse = mla_decode_paged(
        q, pool_2d(latent_pool), req_to_token, rows, seq_lens, scale, kv_lora_rank, page_size,
        num_splits, out, q_len=q_len,
    )  # fmt: skip
    return (o, lse) if return_lse else o

"""Lightning Indexer scores of decode and verify rows in Triton (`RowIndexScores`).

One program per (group, block of BLOCK_N entries): the block's key rows are looked up in the group's
table row and its keys [BLOCK_N, c] loaded once from the pool (in place: no gathered copy); then for
each of the group's q_len places one tl.dot of the place's heads [H, c] by the keys gives [H, BLOCK_N],
ReLU'd, weighted by the place's head weights and summed over the heads, which is the only thing
written. The heads are the dot's M dimension (64 at V4-Flash), so a decode row (q_len 1) fills the
tensor cores as a verify row does. A block past every place's visible entries writes -inf and loads
nothing (a short row inside a graph padded to the longest context).

Bytes: each key row is read once (c * 2 bytes in bf16), the places' queries once per entry block (from
L2 after the first), the scores written once in float32: about (c * 2 + 4 * q_len) bytes an entry,
against the gathered float32 keys plus H float32 scores an entry per place the einsum form took."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import dot_precision, next_pow2
from runtime.gpu.kernels.index_scores.triton import kernel_inputs
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@triton.jit
def _row_index_scores(
    Q, W, K, Table, Vis, Out, width,
    stride_qt, stride_qh, stride_wt, stride_k, stride_tg, stride_ot,
    Q_LEN: tl.constexpr, NUM_HEADS: tl.constexpr, C: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h, offs_c, offs_q = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_Q)
    mask_h, mask_c, mask_n = offs_h < NUM_HEADS, offs_c < C, offs_n < width
    first = g * Q_LEN  # the group's first place
    seen = tl.max(tl.load(Vis + first + offs_q, mask=offs_q < Q_LEN, other=0).to(tl.int32), 0)
    out_row = Out + offs_n
    if tl.program_id(1) * BLOCK_N < seen:
        live = mask_n & (offs_n < seen)
        rows = tl.load(Table + g.to(tl.int64) * stride_tg + offs_n, mask=live, other=0).to(tl.int64)
        keys = tl.load(K + rows[:, None] * stride_k + offs_c[None, :], mask=live[:, None] & mask_c[None, :],
                       other=0.0)  # fmt: skip
        keys_t = tl.trans(dot_operand(keys, DOT_F32))  # [BLOCK_C, BLOCK_N]
        for j in tl.static_range(Q_LEN):
            t = (first + j).to(tl.int64)
            q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_c[None, :],
                        mask=mask_h[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
            s = tl.dot(dot_operand(q, DOT_F32), keys_t, input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
            w = tl.load(W + t * stride_wt + offs_h, mask=mask_h, other=0.0)
            score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
            vis = tl.load(Vis + t).to(tl.int32)
            tl.store(out_row + t * stride_ot, tl.where(offs_n < vis, score, float("-inf")), mask=mask_n)
    else:
        for j in tl.static_range(Q_LEN):
            t = (first + j).to(tl.int64)
            tl.store(out_row + t * stride_ot, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=mask_n)


def row_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
):
    """`RowIndexScores`."""
    tokens, heads, c = q.shape
    groups, width = table.shape
    keys, weights = kernel_inputs(q, weights, keys)
    table = table if table.stride(-1) == 1 else table.contiguous()
    out = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    if tokens == 0 or width == 0:
        return out
    assert tokens % groups == 0, (q.shape, table.shape)
    q_len = tokens // groups
    cuda = q.is_cuda
    block_n = (128 if q.dtype != torch.float32 else 64) if cuda else 16
    _row_index_scores[(groups, triton.cdiv(width, block_n))](
        q, weights, keys, table, visible, out, width,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), table.stride(0), out.stride(0),
        Q_LEN=q_len, NUM_HEADS=heads, C=c, BLOCK_H=max(16, next_pow2(heads)), BLOCK_C=max(16, next_pow2(c)),
        BLOCK_Q=next_pow2(q_len), BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q),
        num_warps=8 if cuda else 1, num_stages=2 if cuda else 1,
    )  # fmt: skip
    return out

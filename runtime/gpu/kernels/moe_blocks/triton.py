"""The fixed blocks in Triton. `pack`: one program per pair; its row in the destination's block is the
number of earlier pairs going to the same rank (the reference's layout), counted by the program itself
over the slots before it (at most a few thousand pairs in a low-latency step, read from L2), so there
are no counters to clear and no atomics; then the pair copies its token's row. `combine`: one program per
(token, column block) sums the token's k rows in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 1024
BLOCK_P = 1024  # slots counted per loop step


@triton.jit
def _pack(
    X, W, Slots, Rows, RowW, RowIds, Where, k, per_rank, cap, d, stride_x,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + pair)
    dest = slot // per_rank
    earlier = 0
    for p0 in range(0, pair, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        before = offs < pair
        other = tl.load(Slots + offs, mask=before, other=0)
        earlier += tl.sum(((other // per_rank == dest) & before).to(tl.int32))
    row = dest * cap + earlier
    tl.store(Where + pair, row)
    tl.store(RowW + row, tl.load(W + pair).to(tl.float32))
    tl.store(RowIds + row, slot % per_rank)
    src = X + (pair // k) * stride_x
    for d0 in range(0, d, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < d
        tl.store(Rows + row * d + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _combine(Rows, Where, Out, k, d, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < d
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(k):
        row = tl.load(Where + t * k + j)
        acc += tl.load(Rows + row * d + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * d + offs, acc.to(Out.dtype.element_ty), mask=mask)


def pack(x, weights, slots, per_rank, ep, cap):  # noqa: ANN001, ANN201
    """`PackBlocks`. Blocks that the pairs fill exactly (one rank, cap = T * k: the world-size-1 path)
    are not cleared first: every row is written."""
    t, k = slots.shape
    assert x.stride(1) == 1
    slots, weights = slots.contiguous(), weights.contiguous()
    d, n = x.shape[1], ep * cap
    full = ep == 1 and cap == t * k
    alloc = torch.empty if full else torch.zeros
    rows = alloc(n, d, dtype=x.dtype, device=x.device)
    w = alloc(n, dtype=torch.float32, device=x.device)
    ids = alloc(n, dtype=torch.int64, device=x.device)
    where = torch.empty(t, k, dtype=torch.int64, device=x.device)
    if t * k:
        _pack[(t * k,)](
            x, weights, slots, rows, w, ids, where, k, per_rank, cap, d, x.stride(0),
            BLOCK_D=min(BLOCK_D, triton.next_power_of_2(d)), BLOCK_P=BLOCK_P, num_warps=4,
        )  # fmt: skip
    return rows, w, ids, where


def combine(rows, where):  # noqa: ANN001, ANN201
    """`CombineBlocks`."""
    t, k = where.shape
    d = rows.shape[1]
    assert rows.is_contiguous() and where.is_contiguous()
    out = torch.empty(t, d, dtype=rows.dtype, device=rows.device)
    block = min(BLOCK_D, triton.next_power_of_2(d))
    if t:
        _combine[(t, triton.cdiv(d, block))](rows, where, out, k, d, BLOCK_D=block, num_warps=4)
    return out

"""`layout.moe_layout` in one Triton program: the decode-sized case, where the dozen torch ops of the
PyTorch version cost more in launches (a few microseconds each, in every MoE layer) than in work.

One program, two passes over the T*k expert ids, BLOCK at a time, as one-hot [BLOCK, E] tiles:
pass 1 counts pairs per expert, giving the padded segment starts (cumsum); pass 2 gives each pair its
row, segment start + pairs of the same expert before it (earlier tiles: a running count; this tile:
a cumsum down the one-hot column), which is the stable order `argsort(stable=True)` gives. The work
grows as T*k*E, so large batches (prefill) use the PyTorch version: see `LAYOUT_MAX_PAIRS`.

`block_tile` is how the GEMM kernels read a block of either layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2
from runtime.gpu.kernels.fused_moe.layout import MoELayout, max_blocks

LAYOUT_MAX_PAIRS = 4096  # past this, the torch ops' launches are noise next to the GEMMs


@triton.jit
def _layout(
    Ids, SortedPairs, BlockExpert, NumRows,
    num_pairs, num_experts, max_rows, num_blocks,
    BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        ids = tl.load(Ids + start + offs, mask=start + offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    tl.store(NumRows, tl.sum(padded, 0))
    # padding sentinel everywhere first, and each block's expert: the first segment ending past it
    offs_f = tl.arange(0, BLOCK_F)
    for r0 in range(0, max_rows, BLOCK_F):
        tl.store(
            SortedPairs + r0 + offs_f,
            tl.full([BLOCK_F], 0, tl.int32) + num_pairs,
            mask=r0 + offs_f < max_rows,
        )
    pad_end_live = tl.where(experts < num_experts, pad_end, 2147483647)
    for b0 in range(0, num_blocks, BLOCK_F):
        first_row = (b0 + offs_f) * BM
        e = tl.sum((pad_end_live[None, :] <= first_row[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + b0 + offs_f, tl.minimum(e, num_experts - 1), mask=b0 + offs_f < num_blocks)
    tl.debug_barrier()  # the sentinel stores above land before the rows below overwrite them
    running = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pair = start + offs
        ids = tl.load(Ids + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
        before = tl.cumsum(onehot, 0) - onehot  # same-expert pairs earlier in this tile
        dest = tl.sum(onehot * (before + pad_start[None, :] + running[None, :]), 1)
        tl.store(SortedPairs + dest, pair, mask=pair < num_pairs)
        running += tl.sum(onehot, 0)


def moe_layout_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """Same result as `layout.moe_layout` (bit for bit), in one launch."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    n_blocks = max_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=flat.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    e_pad = next_pow2(max(num_experts, 16))
    _layout[(1,)](
        flat, sorted_pairs, block_expert, num_rows,
        pairs, num_experts, n_blocks * block_m, n_blocks,
        BM=block_m, E_PAD=e_pad, BLOCK=max(16, min(64, 8192 // e_pad)), BLOCK_F=256,
        num_warps=4 if flat.is_cuda else 1,
    )  # fmt: skip
    return MoELayout(sorted_pairs, block_expert, num_rows, pairs, block_m)


@triton.jit
def block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block b of the expert-sorted layout and this program's output columns: the block's expert, its
    rows (pair indices; padding rows hold num_pairs, so `valid` is False there) and the column mask."""
    e = tl.load(BlockExpert + b).to(tl.int64)
    offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(Pairs + offs_m)
    valid = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, offs_m, pair, valid, offs_n, offs_n < N


@triton.jit
def store_swiglu(acc_g, acc_u, limit, H, offs_m, offs_n, stride_hm, valid, mask_n, HAS_LIMIT: tl.constexpr):
    """The gate/up kernels' epilogue: silu(gate) * up (DeepSeek-V4 with `limit`: silu(min(gate, L)) *
    clamp(up, -L, L)) stored to the block's rows of H."""
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(H.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])

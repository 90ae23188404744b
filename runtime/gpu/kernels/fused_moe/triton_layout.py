"""`layout.moe_layout` in Triton: the decode- and verify-sized cases, where the dozen torch ops of the
PyTorch version (a radix sort among them) cost more in launches and passes than the work needs.

Both forms see the T*k expert ids BLOCK at a time, as one-hot [BLOCK, E] tiles. Counting a tile gives
pairs per expert; the padded segment starts are a cumsum of the padded totals; a pair's row is its
segment start + pairs of the same expert before it (earlier tiles: their counts; this tile: a cumsum
down the one-hot column), which is the stable order `argsort(stable=True)` gives, bit for bit.

- `moe_layout_triton`, one program: counts every tile, then places every tile. Serial, so its time grows
  with the tiles (about 50 us at 1,536 pairs); the few tiles of a decode step take one launch.
- `moe_layout_tiled`, two launches of one program per tile: the first counts its tile into a
  [tiles, E] table (and writes the padding sentinel over its share of the rows); the second sums the
  table (all tiles: the segment starts; the tiles before its own: its running counts) and places its
  tile. Each program reads the whole table, so the work grows as tiles^2 * E: past `TILED_MAX_TILES`
  (prefill) the torch ops win. `moe_layout_fast` picks among the three.

`block_tile` is how the GEMM kernels read a block of either layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2
from runtime.gpu.kernels.fused_moe.layout import MoELayout, max_blocks, moe_layout

ONE_PROGRAM_MAX_TILES = 2  # up to here one launch beats two (a decode step's few pairs)
TILED_MAX_TILES = 256  # past this the tiled programs' table reads (tiles^2 * E) outgrow the torch ops


@triton.jit
def _tile_onehot(Ids, start, num_pairs, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """The pairs start.. start + BLOCK and their experts as a one-hot [BLOCK, E_PAD] int32 tile (pairs
    past num_pairs: all zeros)."""
    pair = start + tl.arange(0, BLOCK)
    ids = tl.load(Ids + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
    return pair, (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _place_tile(SortedPairs, pair, onehot, seg_start, num_pairs):
    """Each pair of the tile to its row: its expert's seg_start (segment start + that expert's pairs in
    earlier tiles) + the same expert's pairs earlier in this tile."""
    before = tl.cumsum(onehot, 0) - onehot
    dest = tl.sum(onehot * (before + seg_start[None, :]), 1)
    tl.store(SortedPairs + dest, pair, mask=pair < num_pairs)


@triton.jit
def _fill_sentinel(SortedPairs, num_pairs, max_rows, first, step, BLOCK_F: tl.constexpr):
    """The padding sentinel (num_pairs) over rows first, first + step, ... (BLOCK_F at a time)."""
    offs_f = tl.arange(0, BLOCK_F)
    for r0 in range(first, max_rows, step):
        tl.store(
            SortedPairs + r0 + offs_f,
            tl.full([BLOCK_F], 0, tl.int32) + num_pairs,
            mask=r0 + offs_f < max_rows,
        )


@triton.jit
def _store_block_experts(
    BlockExpert, pad_end, num_experts, num_blocks, first, step,
    BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """Each block's expert (blocks first, first + step, ...): the first segment ending past the block's
    first row, clamped for the blocks past the rows in use."""
    experts = tl.arange(0, E_PAD)
    pad_end_live = tl.where(experts < num_experts, pad_end, 2147483647)
    offs_f = tl.arange(0, BLOCK_F)
    for b0 in range(first, num_blocks, step):
        first_row = (b0 + offs_f) * BM
        e = tl.sum((pad_end_live[None, :] <= first_row[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + b0 + offs_f, tl.minimum(e, num_experts - 1), mask=b0 + offs_f < num_blocks)


@triton.jit
def _layout(
    Ids, SortedPairs, BlockExpert, NumRows,
    num_pairs, num_experts, max_rows, num_blocks,
    BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        _, onehot = _tile_onehot(Ids, start, num_pairs, E_PAD, BLOCK)
        counts += tl.sum(onehot, 0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    tl.store(NumRows, tl.sum(padded, 0))
    # padding sentinel everywhere first, and each block's expert
    _fill_sentinel(SortedPairs, num_pairs, max_rows, 0, BLOCK_F, BLOCK_F)
    _store_block_experts(BlockExpert, pad_end, num_experts, num_blocks, 0, BLOCK_F, BM, E_PAD, BLOCK_F)
    tl.debug_barrier()  # the sentinel stores above land before the rows below overwrite them
    seg_start = pad_end - padded
    for start in range(0, num_pairs, BLOCK):
        pair, onehot = _tile_onehot(Ids, start, num_pairs, E_PAD, BLOCK)
        _place_tile(SortedPairs, pair, onehot, seg_start, num_pairs)
        seg_start += tl.sum(onehot, 0)


def moe_layout_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """Same result as `layout.moe_layout` (bit for bit), in one launch."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    n_blocks = max_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=flat.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    e_pad, block = _tile_size(num_experts)
    _layout[(1,)](
        flat, sorted_pairs, block_expert, num_rows,
        pairs, num_experts, n_blocks * block_m, n_blocks,
        BM=block_m, E_PAD=e_pad, BLOCK=block, BLOCK_F=256,
        num_warps=4 if flat.is_cuda else 1,
    )  # fmt: skip
    return MoELayout(sorted_pairs, block_expert, num_rows, pairs, block_m)


def _tile_size(num_experts: int) -> tuple[int, int]:
    """E_PAD and the pairs a one-hot tile holds: [BLOCK, E_PAD] int32 stays near 8K elements."""
    e_pad = next_pow2(max(num_experts, 16))
    return e_pad, max(16, min(64, 8192 // e_pad))


@triton.jit
def _count_tiles(
    Ids, TileCounts, SortedPairs, num_pairs, max_rows,
    E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    """Program t: TileCounts[t, e] = pairs of tile t routed to expert e; the sentinel over its rows."""
    t = tl.program_id(0)
    _, onehot = _tile_onehot(Ids, t * BLOCK, num_pairs, E_PAD, BLOCK)
    tl.store(TileCounts + t * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, 0))
    _fill_sentinel(SortedPairs, num_pairs, max_rows, t * BLOCK_F, tl.num_programs(0) * BLOCK_F, BLOCK_F)


@triton.jit
def _place_tiles(
    Ids, TileCounts, SortedPairs, BlockExpert, NumRows,
    num_pairs, num_experts, num_blocks,
    BM: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):  # fmt: skip
    """Program t: the segment starts from every tile's counts, its running counts from the tiles before
    it, then its pairs' rows; and its share of the blocks' experts (program 0: the rows in use)."""
    t = tl.program_id(0)
    n_tiles = tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    running = tl.zeros([E_PAD], tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        c = tl.load(
            TileCounts + tiles[:, None] * E_PAD + experts[None, :], mask=(tiles < n_tiles)[:, None], other=0
        )
        counts += tl.sum(c, 0)
        running += tl.sum(tl.where((tiles < t)[:, None], c, 0), 0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    if t == 0:
        tl.store(NumRows, tl.sum(padded, 0))
    pair, onehot = _tile_onehot(Ids, t * BLOCK, num_pairs, E_PAD, BLOCK)
    _place_tile(SortedPairs, pair, onehot, pad_end - padded + running, num_pairs)
    _store_block_experts(
        BlockExpert, pad_end, num_experts, num_blocks, t * BLOCK_F, n_tiles * BLOCK_F, BM, E_PAD, BLOCK_F
    )


def moe_layout_tiled(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """Same result as `layout.moe_layout` (bit for bit), in two launches of one program per tile."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    n_blocks = max_blocks(pairs, num_experts, block_m)
    e_pad, block = _tile_size(num_experts)
    n_tiles = triton.cdiv(pairs, block)
    dev = flat.device
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    tile_counts = torch.empty(n_tiles, e_pad, dtype=torch.int32, device=dev)
    warps = 4 if flat.is_cuda else 1
    _count_tiles[(n_tiles,)](
        flat, tile_counts, sorted_pairs, pairs, n_blocks * block_m,
        E_PAD=e_pad, BLOCK=block, BLOCK_F=256, num_warps=warps,
    )  # fmt: skip
    _place_tiles[(n_tiles,)](
        flat, tile_counts, sorted_pairs, block_expert, num_rows, pairs, num_experts, n_blocks,
        BM=block_m, E_PAD=e_pad, BLOCK=block, BLOCK_T=max(1, min(32, 8192 // e_pad)), BLOCK_F=256,
        num_warps=warps,
    )  # fmt: skip
    return MoELayout(sorted_pairs, block_expert, num_rows, pairs, block_m)


def moe_layout_fast(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """The layout by whichever form is quickest at this many pairs (all give the same layout)."""
    tiles = -(-topk_ids.numel() // _tile_size(num_experts)[1])
    if tiles <= ONE_PROGRAM_MAX_TILES:
        return moe_layout_triton(topk_ids, num_experts, block_m)
    if tiles <= TILED_MAX_TILES:
        return moe_layout_tiled(topk_ids, num_experts, block_m)
    return moe_layout(topk_ids, num_experts, block_m)


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

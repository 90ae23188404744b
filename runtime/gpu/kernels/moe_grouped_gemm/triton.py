"""Grouped MoE GEMM (bf16/fp16, contiguous layout) in Triton: one launch over all experts.

Each expert's rows are cut into BLOCK_M tiles; a tile never spans two experts. The tile -> (expert, first
row) map is built on the device from the offsets (no host sync): the grid is the upper bound
ceil(T / BLOCK_M) + E tiles x N tiles, and programs past the real tile count exit at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import dot_precision
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@triton.jit
def _grouped(
    X, W, Y, TileExpert, TileStart, Offsets, num_tiles, N, K,
    stride_xm, stride_we, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    if t >= tl.load(num_tiles):
        return
    pid_n = tl.program_id(1)
    e = tl.load(TileExpert + t).to(tl.int64)
    start = tl.load(TileStart + t)
    end = tl.load(Offsets + e + 1)
    rows = start + tl.arange(0, BLOCK_M)
    mask_m = rows < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = offs_k < K - k0
        a = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mk[None, :], other=0.0)
        b = tl.load(w_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(dot_operand(a, DOT_F32), dot_operand(b, DOT_F32), acc, input_precision=DOT_PREC)
    y_ptrs = Y + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_map(offsets: torch.Tensor, max_tiles: int, block_m: int):
    """(tile expert [max_tiles], tile first row [max_tiles], real tile count [1]) on the device."""
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(ends, t, right=True).clamp(max=counts.numel() - 1)
    first_tile = ends[expert] - tiles[expert]
    start = offsets[:-1].to(torch.int64)[expert] + (t - first_tile) * block_m
    return expert.to(torch.int32), start.to(torch.int32), ends[-1:].to(torch.int32)


def moe_grouped_gemm(x, w, offsets, out=None):
    """`MoeGroupedGemm`."""
    t, k = x.shape
    num_experts, n, _ = w.shape
    assert w.shape[2] == k and x.stride(1) == 1 and w.stride(2) == 1
    out = x.new_empty(t, n) if out is None else out
    if t == 0:
        return out
    on_gpu = x.device.type == "cuda"
    bm, bn, bk = (64, 128, 64) if on_gpu else (16, 32, 32)
    max_tiles = -(-t // bm) + num_experts
    expert, start, count = tile_map(offsets, max_tiles, bm)
    _grouped[(max_tiles, -(-n // bn))](
        x, w, out, expert, start, offsets, count, n, k,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=dot_precision(x.dtype), DOT_F32=dot_f32(x),
        num_warps=4 if on_gpu else 1, num_stages=3 if on_gpu else 1,
    )  # fmt: skip
    return out

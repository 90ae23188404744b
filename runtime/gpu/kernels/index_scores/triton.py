"""Lightning Indexer scores in Triton (`IndexScores`).

One program per (block of BLOCK_M queries, block of BLOCK_N entries): the entries' keys [BLOCK_N, c] are
loaded once, then for each indexer head the queries' rows [BLOCK_M, c] are multiplied by them (one
tl.dot), ReLU'd, weighted and summed into a [BLOCK_M, BLOCK_N] float32 accumulator, which is the only
thing written. A block no query of which may see is written as -inf without loading anything (causal
prefill: about half the blocks of a square tile). c = 128 at V4-Flash (index_head_dim), one tile.

Per block, the dots are 2 * BLOCK_M * BLOCK_N * c * H FLOPs for (BLOCK_M + BLOCK_N) * c * H * 2 bytes of
q and keys read (keys from L1/registers after the first head): the queries' rows are re-read once per
entry block, from L2 for the blocks of one query block that run together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import dot_precision, next_pow2
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@dataclass(frozen=True)
class IndexConfig:
    block_m: int = 64  # queries per program
    block_n: int = 128  # entries per program
    num_warps: int = 8
    num_stages: int = 2


def default_config(dtype: torch.dtype, device: torch.device) -> IndexConfig:
    """Untuned: a 64 x 128 float32 accumulator (8 warps) at c = 128; float32 inputs, twice as wide in
    shared memory, half the blocks; small blocks under the interpreter."""
    if device.type != "cuda":
        return IndexConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return IndexConfig(block_m=32, block_n=64, num_warps=4)
    return IndexConfig()


@triton.jit
def _index_scores(
    Q, W, K, Vis, Out, num_tokens, num_entries,
    stride_qt, stride_qh, stride_wt, stride_k, stride_ot,
    NUM_HEADS: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    mask_m, mask_n, mask_c = offs_m < num_tokens, offs_n < num_entries, offs_c < C
    vis = tl.load(Vis + offs_m, mask=mask_m, other=0).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if tl.program_id(1) * BLOCK_N < tl.max(vis, 0):  # some query of the block sees some entry of it
        keys = tl.load(K + offs_n[:, None].to(tl.int64) * stride_k + offs_c[None, :],
                       mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
        keys_t = tl.trans(dot_operand(keys, DOT_F32))
        q_rows = Q + offs_m[:, None].to(tl.int64) * stride_qt + offs_c[None, :]
        w_rows = W + offs_m.to(tl.int64) * stride_wt
        for h in range(NUM_HEADS):
            q = tl.load(q_rows + h * stride_qh, mask=mask_m[:, None] & mask_c[None, :], other=0.0)
            s = tl.dot(dot_operand(q, DOT_F32), keys_t, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
            w = tl.load(w_rows + h, mask=mask_m, other=0.0)
            acc += tl.maximum(s, 0.0) * w[:, None]
    acc = tl.where(offs_n[None, :] < vis[:, None], acc, float("-inf"))
    out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def kernel_inputs(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """keys and float32 weights with unit last strides, as both indexer kernels read them (q must have one)."""
    assert q.stride(-1) == 1 and keys.shape[1] == q.shape[2] and keys.dtype == q.dtype, (
        q.shape,
        keys.shape,
        keys.dtype,
    )
    weights = weights.float()
    unit = [t if t.stride(-1) == 1 else t.contiguous() for t in (keys, weights)]
    return unit[0], unit[1]


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor):
    """`IndexScores`."""
    tokens, heads, c = q.shape
    n = keys.shape[0]
    keys, weights = kernel_inputs(q, weights, keys)
    out = torch.empty(tokens, n, dtype=torch.float32, device=q.device)
    if tokens == 0 or n == 0:
        return out
    cfg = default_config(q.dtype, q.device)
    grid = (triton.cdiv(tokens, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _index_scores[grid](
        q, weights, keys, visible, out, tokens, n,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0),
        NUM_HEADS=heads, C=c, BLOCK_C=max(16, next_pow2(c)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PREC=dot_precision(q.dtype), DOT_F32=dot_f32(q),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out

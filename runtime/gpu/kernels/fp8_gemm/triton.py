"""FP8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) and the per-token-group
activation quantizer, in Triton.

GEMM: one program per (BLOCK_M x BLOCK_N output tile, K split). Each K step is one 128-wide scale group:
an fp8 x fp8 `tl.dot` (Hopper wgmma, float32 accumulate) whose result is multiplied by the activation
scales of the tile's rows and the weight block scale of its columns, then added to the float32
accumulator (the "promotion" DeepGEMM does on CUDA cores). Out-of-range rows/columns are read wrapped
(no load masks) and dropped at the store. Small M: the K loop is split over programs (float32 partials
summed afterwards) so a few output tiles still fill the GPU.

Quantizer: one program per (row, GROUPS_PER_PROG groups of 128): absmax / 448 -> scale, x / scale ->
e4m3 (round to nearest even on the GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import num_sms
from runtime.gpu.kernels.fp8_gemm.reference import EPS, FP8, FP8_MAX, GROUP


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def choose_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Fixed guesses, not tuned on the device (SGLang's tuned H100/H200 block-FP8 configs are mostly
    64x128, 4 warps, 3 stages at large M). Small M: a narrower N tile and split-K until the grid covers
    the SMs."""
    if device.type != "cuda":
        return GemmConfig(block_m=16, block_n=32, split_k=2 if k > GROUP else 1, num_warps=1, num_stages=1)
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        tiles = -(-m // block_m) * -(-n // 64)
        k_blocks = -(-k // GROUP)
        split = 1
        while tiles * split < num_sms(device) and k_blocks // (2 * split) >= 4:
            split *= 2
        return GemmConfig(block_m=block_m, block_n=64, split_k=split, num_warps=4, num_stages=4)
    if m <= 256:
        return GemmConfig(block_m=64, block_n=128 if n >= 4096 else 64, num_warps=4, num_stages=4)
    return GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _gemm(
    A, AS, B, BS, C, M, N, K, k_blocks_per_split,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # grouped order: GROUP_M row tiles share the weight tiles in L2
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = AS + offs_m * stride_asm
    bs_ptrs = BS + (offs_n // BLOCK_K) * stride_bsn

    kb_start = split * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(kb_start, kb_end):
        k0 = kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
        else:
            a = tl.load(a_ptrs + k0, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs + k0, mask=offs_k[:, None] < K - k0, other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask)
        b_s = tl.load(bs_ptrs + kb * stride_bsk)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + split.to(tl.int64) * stride_cs + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _act_quant(
    X, Q, S, K, num_groups, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] < num_groups) & (cols < K)
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), EPS) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(Q + row * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + groups, scale, mask=groups < num_groups)


def fp8_act_quant(x, group=GROUP):
    """`Fp8ActQuant` (group 128 only)."""
    assert group == GROUP and x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    g = -(-k // group)
    # The Triton interpreter (CPU) converts float32 -> e4m3 wrongly (124.3 -> 64, ties away from even):
    # there the kernel writes the scaled float32 values and torch rounds them to e4m3.
    on_gpu = x.device.type == "cuda"
    q = torch.empty(m, k, dtype=FP8 if on_gpu else torch.float32, device=x.device)
    s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m == 0:
        return q.to(FP8), s
    per = 8 if x.device.type == "cuda" else 2
    _act_quant[(m, -(-g // per))](
        x, q, s, k, g, x.stride(0), q.stride(0), s.stride(0),
        GROUP=group, GROUPS_PER_PROG=per, FP8_MAX=FP8_MAX, EPS=EPS, num_warps=4,
    )  # fmt: skip
    return (q, s) if on_gpu else (q.to(FP8), s)


def fp8_block_gemm(x_fp8, x_scale, w, w_scale, out_dtype=torch.bfloat16, out=None, config=None):
    """`Fp8BlockGemm` (`config`: the launch, `choose_config`'s when None)."""
    m, k = x_fp8.shape
    n = w.shape[0]
    assert w.shape[1] == k and x_fp8.stride(1) == 1 and w.stride(1) == 1
    assert x_scale.shape == (m, -(-k // GROUP)) and w_scale.shape == (-(-n // GROUP), -(-k // GROUP))
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device) if out is None else out
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0 or n == 0:
        return out
    cfg = config or choose_config(m, n, k, x_fp8.device)
    k_blocks = -(-k // GROUP)
    split = max(1, min(cfg.split_k, k_blocks))
    per_split = -(-k_blocks // split)
    split = -(-k_blocks // per_split)
    dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), split)
    _gemm[grid](
        x_fp8, x_scale, w, w_scale, dst, m, n, k, per_split,
        x_fp8.stride(0), x_scale.stride(0), x_scale.stride(1), w.stride(0), w_scale.stride(0),
        w_scale.stride(1), dst.stride(0) if split > 1 else 0, dst.stride(-2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=GROUP, GROUP_M=cfg.group_m, EVEN_K=k % GROUP == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        sum_splits(dst, out)
    return out


def sum_splits(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = the sum of split-K float32 partials [S, M, N] (in place for a float32 out)."""
    if out.dtype == torch.float32:
        return torch.sum(partials, dim=0, out=out)
    return out.copy_(partials.sum(0))

"""FP8 block-scaled weights times an unquantized bf16/fp16 activation (W8A16), for decode-sized M.

At a few rows per step the GEMM is a stream of weight bytes, and the W8A8 path (`fp8_linear` above 16
rows) spends a launch quantizing x and, at small M, another summing split-K partials: a few
microseconds each, for each of the step's ~100 projections. Here one launch reads x as it is, converts
each 128-wide block of W to x's dtype in registers (every e4m3 value is exact in bf16 and fp16), and
applies the block's scale to the float32 partial. No activation rounding, so the result is closer to
the dequantized-weight product than W8A8's. Without split-K it loses to W8A8 at long K (docs/PERF.md),
which is why `fp8_linear` sends it only K <= 4096.

One program per (BLOCK_N columns, BLOCK_M rows); BLOCK_N divides 128, so a program's columns share one
weight-scale row, and each K step is one scale group. A block-diagonal weight (`groups`, DeepSeek-V4's
o_a_proj) is one launch too: a program's columns lie in one group, whose columns of x it reads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import num_sms
from runtime.gpu.kernels.fp8_gemm.reference import GROUP
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@triton.jit
def _gemm(
    X, W, WS, Y, M, N, K, group_rows,
    stride_xm, stride_wn, stride_wsn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_group = ((pid_n * BLOCK_N) // group_rows) * K  # block-diagonal weights: this group's columns of x
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + x_group + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    ws_ptr = WS + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0)
        else:
            in_k = offs_k[None, :] < K - k0
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & in_k, other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & in_k, other=0.0)
        part = tl.dot(dot_operand(x, DOT_F32), dot_operand(tl.trans(w.to(X.dtype.element_ty)), DOT_F32))
        acc += part * tl.load(ws_ptr + kb)
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def launch(m: int, n: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): 32 columns a program when that still gives every SM a program,
    else 16 (the narrowest tl.dot), so small projections spread their weight bytes over more SMs."""
    if device.type != "cuda":
        return 16, 16, 1, 1
    block_m = 16 if m <= 16 else 32
    block_n = 32 if -(-n // 32) * -(-m // block_m) >= num_sms(device) else 16
    return block_m, block_n, 4, 4


def fp8_weight_gemm(x, w, w_scale, out=None, groups=1):
    """`Fp8WeightGemm`."""
    m, k = x.shape[0], x.shape[1] // groups
    n = w.shape[0]
    assert w.shape[1] == k and x.shape[1] == groups * k and x.stride(1) == 1 and w.stride(1) == 1
    assert groups == 1 or (n // groups) % GROUP == 0, (n, groups)
    assert w_scale.shape == (-(-n // GROUP), -(-k // GROUP)), (w.shape, w_scale.shape)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0 or n == 0:
        return out
    block_m, block_n, warps, stages = launch(m, n, x.device)
    w_scale = w_scale.float()
    _gemm[(-(-n // block_n), -(-m // block_m))](
        x, w, w_scale, out, m, n, k, n // groups, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, EVEN_K=k % GROUP == 0, DOT_F32=dot_f32(x),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out

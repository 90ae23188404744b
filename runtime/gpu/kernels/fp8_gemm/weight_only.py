"""FP8 block-scaled weights times an unquantized bf16/fp16 activation (W8A16), for decode-sized M.

At a few rows per step the GEMM is a stream of weight bytes, and the W8A8 path (`fp8_linear` above 16
rows) spends a launch quantizing x and, at small M, another summing split-K partials: a few
microseconds each, for each of the step's ~100 projections. Here one launch reads x as it is, converts
each 128-wide block of W to x's dtype in registers (every e4m3 value is exact in bf16 and fp16), and
applies the block's scale to the float32 partial. No activation rounding, so the result is closer to
the dequantized-weight product than W8A8's. Without split-K it loses to W8A8 at long K (docs/PERF.md),
which is why `fp8_linear` sends it only K <= 4096.

One program per (BLOCK_N columns, BLOCK_M rows); BLOCK_N divides 128, so a program's columns share one
weight-scale row, and each K step is one scale group."""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import num_sms
from runtime.gpu.kernels.fp8_gemm.reference import GROUP
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand


@triton.jit
def _gemm(
    X, W, WS, Y, M, N, K,
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
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
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


def fp8_weight_gemm(x, w, w_scale, out=None):
    """`Fp8WeightGemm`."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    assert w_scale.shape == (-(-n // GROUP), -(-k // GROUP)), (w.shape, w_scale.shape)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0 or n == 0:
        return out
    block_m, block_n, warps, stages = launch(m, n, x.device)
    w_scale = w_scale.float()
    _gemm[(-(-n // block_n), -(-m // block_m))](
        x, w, w_scale, out, m, n, k, x.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, EVEN_K=k % GROUP == 0, DOT_F32=dot_f32(x),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------ benchmark

# (N, K) of DeepSeek-V3's dense projections (q_a, q_b, kv_a, o, shared-expert gate|up and down) and
# V2-Lite's (q, kv_a, o, shared gate|up, down)
SHAPES = {
    "v3": [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048)],
    "v2-lite": [(3072, 2048), (576, 2048), (2048, 2048), (5632, 2048), (2048, 2816)],
}


def main(argv: list[str] | None = None) -> None:
    """`python -m runtime.gpu.kernels.fp8_gemm.weight_only`: per projection, CUDA-graph replay time of
    this kernel, of W8A8 (`fp8_act_quant` + `fp8_block_gemm` from the registry) and of a bf16 matmul
    with the dequantized weight; weight-read bandwidth of the first two."""
    from runtime.gpu.kernels.bench import bench_ms
    from runtime.gpu.kernels.fp8_gemm import FP8_ACT_QUANT, FP8_BLOCK_GEMM
    from runtime.gpu.kernels.fp8_gemm.reference import fp8_weight_gemm as reference
    from runtime.gpu.kernels.testing import close_ratio
    from runtime.gpu.quant.fp8 import quantize

    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, nargs="*", default=[1, 4, 16, 32])
    p.add_argument("--model", choices=sorted(SHAPES), nargs="*", default=sorted(SHAPES))
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    quant = FP8_ACT_QUANT.get(dev)
    block = FP8_BLOCK_GEMM.get(dev)
    print(f"# {torch.cuda.get_device_name(dev)}, fp8_block_gemm = {FP8_BLOCK_GEMM.select(dev).name}")
    print(f"{'model':<8} {'N x K':<12} {'M':>3} {'w8a16 us':>9} {'GB/s':>6} {'w8a8 us':>8} {'GB/s':>6} "
          f"{'bf16 us':>8} {'check':>6}")  # fmt: skip
    for model in a.model:
        for n, k in SHAPES[model]:
            g = torch.Generator(dev).manual_seed(n + k)
            wq, ws = quantize(torch.randn(n, k, device=dev, generator=g) * 0.05, (GROUP, GROUP))
            w_bf16 = (
                wq.float() * ws.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:n, :k]
            ).bfloat16()
            for m in a.m:
                x = torch.randn(m, k, device=dev, generator=g).bfloat16()
                want = reference(x, wq, ws)
                ratio = close_ratio(fp8_weight_gemm(x, wq, ws), want, 1e-2, 1e-2)
                calls = (
                    lambda x=x, wq=wq, ws=ws: fp8_weight_gemm(x, wq, ws),
                    lambda x=x, wq=wq, ws=ws: block(*quant(x), wq, ws),
                    lambda x=x, w=w_bf16: x @ w.T,
                )
                t16, t88, tbf = (bench_ms(fn, dev, graph=True) * 1e3 for fn in calls)
                print(
                    f"{model:<8} {f'{n}x{k}':<12} {m:>3} {t16:9.1f} {n * k / t16 / 1e3:6.0f} {t88:8.1f} "
                    f"{n * k / t88 / 1e3:6.0f} {tbf:8.1f} {ratio:6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

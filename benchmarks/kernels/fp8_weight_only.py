"""The weight-only FP8 GEMM (W8A16, `runtime/gpu/kernels/fp8_gemm/weight_only.py`) per DeepSeek
projection: CUDA-graph replay time of it, of W8A8 (`fp8_act_quant` + `fp8_block_gemm` from the registry)
and of a bf16 matmul with the dequantized weight; weight-read bandwidth of the first two. The figures
behind `fp8_linear`'s WEIGHT_ONLY_MAX_M / WEIGHT_ONLY_MAX_K.

    python -m benchmarks.kernels.fp8_weight_only [--m 1 4 16 32] [--model v3 v2-lite]"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.timing import bench_ms
from runtime.gpu.kernels.fp8_gemm import FP8_ACT_QUANT, FP8_BLOCK_GEMM
from runtime.gpu.kernels.fp8_gemm.reference import GROUP
from runtime.gpu.kernels.fp8_gemm.reference import fp8_weight_gemm as reference
from runtime.gpu.kernels.fp8_gemm.weight_only import fp8_weight_gemm
from runtime.gpu.kernels.testing import close_ratio
from runtime.gpu.quant.fp8 import quantize

# (N, K) of DeepSeek-V3's dense projections (q_a, q_b, kv_a, o, shared-expert gate|up and down) and
# V2-Lite's (q, kv_a, o, shared gate|up, down)
SHAPES = {
    "v3": [(1536, 7168), (24576, 1536), (576, 7168), (7168, 16384), (4096, 7168), (7168, 2048)],
    "v2-lite": [(3072, 2048), (576, 2048), (2048, 2048), (5632, 2048), (2048, 2816)],
}


def main(argv: list[str] | None = None) -> None:
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

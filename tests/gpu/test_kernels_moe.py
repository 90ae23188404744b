"""Grouped MoE GEMM (op `moe_grouped_gemm`, contiguous layout) vs the reference on CUDA: V3 expert shapes
(gate/up 2*2048 x 7168, down 7168 x 2048), prefill- and decode-sized batches, empty and ragged experts.
`pytest -s` prints the error ratio (<= 1 passes) and TFLOP/s of one timed call."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "tokens,experts,n,k",
    [(64, 8, 4096, 7168), (4096, 8, 4096, 7168), (8192, 16, 7168, 2048), (33, 5, 200, 300)],
)
def test_moe_grouped_gemm_matches_reference(tokens: int, experts: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(tokens + experts)
    counts = torch.multinomial(torch.ones(experts), tokens, replacement=True, generator=g).bincount(
        minlength=experts
    )
    counts[0] = 0  # an empty expert
    counts[-1] += tokens - int(counts.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).cuda()
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(experts, n, k, device="cuda") * 0.05).to(torch.bfloat16)
    impl = registry.op("moe_grouped_gemm").named("triton").load()
    want = registry.op("moe_grouped_gemm").implementations()[-1].load()(x, w, offsets)
    got = impl(x, w, offsets)
    import triton.testing

    ms = triton.testing.do_bench(lambda: impl(x, w, offsets), warmup=5, rep=20)
    ratio = close_ratio(got, want, *TOLERANCE[torch.bfloat16])
    print(
        f"\n  T={tokens} E={experts} N={n} K={k}: {ratio:.3f}x tol, {ms * 1e3:.1f} us, "
        f"{2 * tokens * n * k / ms / 1e9:.1f} TFLOP/s"
    )
    assert ratio <= 1.0

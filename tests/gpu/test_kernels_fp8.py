"""FP8 block GEMM (op `fp8_block_gemm`) and the activation quantizer (`fp8_act_quant`) on CUDA: every
implementation vs the PyTorch reference (dequantize + float32 matmul) at DeepSeek-V3 shapes (M 1, 64,
128, 4096; N x K 7168x2048, 4096x7168, 2112x7168) and ragged ones. Both sides use the same quantized
inputs, so the tolerance only covers accumulation order and the bf16 output rounding; `pytest -s` also
prints the error of the whole fp8 path against the unquantized bf16 matmul (information). The TileLang
kernel is also run in every tile config the benchmark compares, and split K (a compile each, ~5-10 s;
TileLang caches them on disk)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.fp8_gemm import reference
from runtime.gpu.kernels.testing import close_ratio, impl_names, load_impl
from runtime.gpu.quant.fp8 import quantize

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


NK = [(7168, 2048), (4096, 7168), (2112, 7168)]
SHAPES = [(m, n, k) for m in (1, 64, 128, 4096) for n, k in NK] + [
    (5, 100, 300),
    (33, 2112, 7168),
    (300, 257, 1000),
    (5, 100, 384),  # ragged M and N with K a multiple of 128 (the TileLang kernel's own path)
    (300, 257, 1024),
    (130, 2112, 7168),
]


def _case(m: int, n: int, k: int) -> tuple:
    g = torch.Generator("cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    xq, xs = reference.act_quant(x)
    wq, ws = quantize(w, (128, 128))
    return x, w, (xq, xs, wq, ws)


@pytest.mark.parametrize("name", impl_names("fp8_block_gemm"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}-n{}-k{}".format(*s))
def test_fp8_block_gemm_matches_reference(name: str, shape: tuple) -> None:
    m, n, k = shape
    if name == "deep_gemm" and (n % 64 or k % 128):
        pytest.skip("DeepGEMM needs N % 64 == 0 and K % 128 == 0")
    x, w, args = _case(m, n, k)
    want = reference.fp8_block_gemm(*args)
    got = load_impl("fp8_block_gemm", name)(*args)
    ratio = close_ratio(got, want, 2e-3 * want.abs().max().item(), 1e-2)
    print(
        f"\n  {name} {shape}: {ratio:.3f}x tol; fp8 path vs bf16 matmul rel. error {_rel(got, x @ w.T):.4f}"
    )
    assert got.dtype == torch.bfloat16 and ratio <= 1.0


def _tilelang_configs() -> list:
    from benchmarks.kernels.fp8_gemm import TILELANG_CONFIGS
    from runtime.gpu.kernels.fp8_gemm.tilelang import TileConfig

    return [
        *TILELANG_CONFIGS,
        TileConfig(64, 64, 4, 128, split_k=2),
        TileConfig(128, 128, 4, 256, split_k=4),
        TileConfig(schedule="pd"),
    ]


@pytest.mark.parametrize("cfg", _tilelang_configs(), ids=lambda c: c.label())
def test_fp8_block_gemm_tilelang_every_config_matches_reference(cfg) -> None:
    """Each tile config the benchmark compares (and split-K), at a shape ragged in M and N, writing into
    a strided `out`."""
    fn = load_impl("fp8_block_gemm", "tilelang")
    m, n, k = 300, 257, 1024
    _, _, args = _case(m, n, k)
    want = reference.fp8_block_gemm(*args)
    out = torch.full((m, n + 7), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :n]
    got = fn(*args, out=out, config=cfg)
    ratio = close_ratio(got, want, 2e-3 * want.abs().max().item(), 1e-2)
    print(f"\n  tilelang {cfg.label()}: {ratio:.3f}x tol")
    assert got.data_ptr() == out.data_ptr() and ratio <= 1.0


@pytest.mark.parametrize("cfg", ["128x128s4t256k1-pd", "128x128s3t256k1-pd"])
def test_fp8_block_gemm_persistent_walks_many_tiles(cfg: str) -> None:
    """The persistent kernel with more output tiles than CTAs (16 x 9 = 144 on 132 SMs: some CTAs take
    two) and 6 K groups on 4 or 3 stages, so the stage ring's position and parity carry from one tile into the next
    without lining up with tile starts; ragged M and N."""
    from runtime.gpu.kernels.fp8_gemm.tilelang import TileConfig

    fn = load_impl("fp8_block_gemm", "tilelang")
    m, n, k = 2000, 1100, 768
    _, _, args = _case(m, n, k)
    want = reference.fp8_block_gemm(*args)
    got = fn(*args, config=TileConfig.parse(cfg))
    ratio = close_ratio(got, want, 2e-3 * want.abs().max().item(), 1e-2)
    print(f"\n  tilelang {cfg} at {m}x{n}x{k}: {ratio:.3f}x tol")
    assert ratio <= 1.0


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
def test_fp8_block_gemm_tilelang_other_output_dtypes(out_dtype: torch.dtype) -> None:
    fn = load_impl("fp8_block_gemm", "tilelang")
    _, _, args = _case(70, 384, 512)
    want = reference.fp8_block_gemm(*args, out_dtype=torch.float32)
    got = fn(*args, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert close_ratio(got, want, 2e-3 * want.abs().max().item(), 1e-2) <= 1.0


@pytest.mark.parametrize("name", impl_names("fp8_act_quant"))
@pytest.mark.parametrize("shape", [(1, 7168), (64, 2048), (4096, 7168), (7, 300)], ids=str)
def test_fp8_act_quant_matches_reference(name: str, shape: tuple) -> None:
    x = (torch.randn(*shape, device="cuda") * 4).to(torch.bfloat16)
    x[0, : min(128, shape[1])] = 0  # an all-zero group
    q, s = load_impl("fp8_act_quant", name)(x)
    qr, sr = reference.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == sr.shape
    scale_err = ((s - sr).abs() / sr).max().item()
    mismatch = (q.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item()
    # x / scale may differ by an ulp of float32 (division vs reciprocal): e4m3 values then differ by at
    # most one e4m3 step, and only at rounding ties. A step is 1/8 of the value for normal numbers and
    # 2^-9 absolute below 2^-6 (subnormals), where it is a large fraction of the value: measure in steps.
    a, b = q.float(), qr.float()
    step = torch.maximum(b.abs() / 8, torch.full_like(b, 2.0**-9))
    steps = ((a - b).abs() / step).max().item()
    print(
        f"\n  {name} {shape}: scale rel err {scale_err:.2e}, e4m3 mismatch {mismatch:.2e}, max {steps:.2f} steps"
    )
    assert scale_err <= 1e-6 and mismatch <= 1e-3 and steps <= 1.0 + 1e-6


@pytest.mark.parametrize(
    "tokens,k", [((2, 64), 7168), ((1, 3), 7168), ((1, 3), 2048)], ids=["w8a8", "w8a8-long-k", "weight-only"]
)
def test_fp8_linear_end_to_end(tokens: tuple[int, int], k: int) -> None:
    """The registry's path on a bf16 activation vs the float32 matmul of the dequantized weight: through
    the quantizer + GEMM (e4m3 activations: a few % off), or at decode-sized M and K <= 4096 through the
    weight-only GEMM (x unquantized: bf16 rounding only)."""
    from runtime.gpu.kernels.fp8_gemm.linear import WEIGHT_ONLY_MAX_K, WEIGHT_ONLY_MAX_M, fp8_linear

    x = torch.randn(*tokens, k, device="cuda").to(torch.bfloat16)
    wq, ws = quantize(torch.randn(2112, k, device="cuda") * 0.05, (128, 128))
    w = reference.dequant_weight(wq, ws)
    y = fp8_linear(x, wq, ws)
    rel = _rel(y, x.float() @ w.T)
    weight_only = tokens[0] * tokens[1] <= WEIGHT_ONLY_MAX_M and k <= WEIGHT_ONLY_MAX_K
    ops = ("fp8_weight_gemm",) if weight_only else ("fp8_act_quant", "fp8_block_gemm")
    chosen = ", ".join(f"{op}={registry.op(op).select('cuda').name}" for op in ops)
    print(f"\n  fp8_linear {tokens} ({chosen}): rel. error vs float32 {rel:.4f}")
    assert y.shape == (*tokens, 2112) and rel < (0.005 if weight_only else 0.06)


@pytest.mark.parametrize("rows", [1, 16, 64, 2048])
def test_fp8_linear_grouped_at_v4_flash_o_a_proj(rows: int) -> None:
    """DeepSeek-V4-Flash's o_a_proj: 8 groups of 1024 rows over 4096 columns each, bf16 x [rows, 8 * 4096];
    decode rows in one weight-only launch, longer ones a block GEMM per group, vs float32 per group."""
    from runtime.gpu.kernels.fp8_gemm.linear import WEIGHT_ONLY_MAX_M, fp8_linear

    x = torch.randn(rows, 8, 4096, device="cuda").to(torch.bfloat16)
    wq, ws = quantize(torch.randn(8 * 1024, 4096, device="cuda") * 0.02, (128, 128))
    w = reference.dequant_weight(wq, ws).view(8, 1024, 4096)
    y = fp8_linear(x.flatten(1), wq, ws, groups=8)
    rel = _rel(y, torch.einsum("mgk,gnk->mgn", x.float(), w).flatten(1))
    import triton.testing

    us = triton.testing.do_bench(lambda: fp8_linear(x.flatten(1), wq, ws, groups=8), warmup=5, rep=20) * 1e3
    print(
        f"\n  grouped fp8_linear rows={rows}: rel. error {rel:.4f}, {us:.1f} us, {wq.numel() / us / 1e3:.0f} GB/s of weights"
    )
    assert y.shape == (rows, 8 * 1024) and rel < (0.005 if rows <= WEIGHT_ONLY_MAX_M else 0.06)


WEIGHT_ONLY_SHAPES = [
    (1, 7168, 2048),
    (1, 576, 7168),
    (16, 2112, 7168),
    (5, 100, 300),
    (16, 257, 1000),
    (9, 300, 384),
]


@pytest.mark.parametrize("name", impl_names("fp8_weight_gemm"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", WEIGHT_ONLY_SHAPES, ids=lambda s: "m{}-n{}-k{}".format(*s))
def test_fp8_weight_gemm_matches_reference(name: str, dtype: torch.dtype, shape: tuple) -> None:
    """W8A16 (decode-sized M): unquantized x against the dequantized weight, ragged N and K included."""
    m, n, k = shape
    x, _, (_, _, wq, ws) = _case(m, n, k)
    x = x.to(dtype)
    want = reference.fp8_weight_gemm(x, wq, ws).float()
    got = load_impl("fp8_weight_gemm", name)(x, wq, ws)
    assert got.dtype == dtype and got.shape == (m, n)
    assert close_ratio(got.float(), want, 2e-3 * want.abs().max().item(), 1e-2) <= 1.0

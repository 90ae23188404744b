"""The MoE ops on CUDA. `fused_moe`: Triton vs the PyTorch reference at DeepSeek-V2-Lite and V3 expert
shapes, decode- and prefill-sized batches, with V4's SwiGLU clamp, and with FP8 experts (e4m3, 128x128
block scales, activations quantized per token and 128-group); the one-program layout vs the torch
one; FP4 experts (packed e2m1, UE8M0 scales per 32, W4A16) at DeepSeek-V4-Flash's shape;
`moe_route` vs its reference (V3 groups, V2 softmax, V4 sqrt-softplus); and the whole op captured in a CUDA graph
(capture fails on any host sync) and replayed on new routing. `pytest -s` prints the error ratio
(<= 1 passes), the time of one call and the bandwidth over the expert weights it touches."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio
from runtime.gpu.quant import fp4
from runtime.gpu.quant.fp8 import quantize

pytestmark = pytest.mark.gpu

SHAPES = {
    "v2lite": (64, 6, 2048, 1408),
    "v3": (256, 8, 7168, 2048),
    "v4flash": (256, 6, 4096, 2048),
    "ragged": (5, 2, 200, 96),
    "ragged32": (5, 2, 224, 96),  # FP4: K in whole groups of 32, not whole K steps
}


def _impl(name: str):
    return registry.op("fused_moe").named(name).load()


@pytest.fixture(scope="module")
def weights():
    cache = {}

    def get(shape: str):
        if shape not in cache:
            cache.clear()  # V3's experts take 22.5 GB: one shape at a time
            e, _, d, i = SHAPES[shape]
            w13 = torch.empty(e, 2 * i, d, device="cuda", dtype=torch.bfloat16).normal_(0, d**-0.5)
            w2 = torch.empty(e, d, i, device="cuda", dtype=torch.bfloat16).normal_(0, i**-0.5)
            cache[shape] = (w13, w2)
        return cache[shape]

    return get


@pytest.fixture(scope="module")
def fp8_weights():
    """(w13, w2, w13_scale, w2_scale): random experts (std 1/sqrt(fan-in)) quantized to e4m3 in 128x128
    blocks, as DeepSeek-V3's checkpoints store them (V3: 11.3 GB; one shape at a time)."""
    cache = {}

    def get(shape: str):
        if shape not in cache:
            cache.clear()
            e, _, d, i = SHAPES[shape]
            g = torch.Generator(device="cuda").manual_seed(e + d + i)
            w13 = torch.empty(e, 2 * i, d, device="cuda", dtype=torch.float8_e4m3fn)
            w2 = torch.empty(e, d, i, device="cuda", dtype=torch.float8_e4m3fn)
            s13 = torch.empty(e, -(-2 * i // 128), -(-d // 128), device="cuda")
            s2 = torch.empty(e, -(-d // 128), -(-i // 128), device="cuda")
            for j in range(e):  # per expert: a float32 V3 expert is 117 MB, all of them 45 GB
                w13[j], s13[j] = quantize(
                    torch.randn(2 * i, d, device="cuda", generator=g) * d**-0.5, (128, 128)
                )
                w2[j], s2[j] = quantize(torch.randn(d, i, device="cuda", generator=g) * i**-0.5, (128, 128))
            cache[shape] = (w13, w2, s13, s2)
        return cache[shape]

    return get


@pytest.fixture(scope="module")
def fp4_weights():
    """(w13, w2, w13_scale, w2_scale): random experts (std 1/sqrt(fan-in)) as packed e2m1 with UE8M0
    scales per 32, as DeepSeek-V4-Flash's checkpoints store them (V4-Flash: 3.4 GB); with `tiled`, in the
    tiled form the served model keeps (`fp4.tile_experts`)."""
    cache = {}

    def get(shape: str, tiled: bool = False):
        if shape not in cache:
            cache.clear()
            e, _, d, i = SHAPES[shape]
            g = torch.Generator(device="cuda").manual_seed(e + d + i)

            def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
                w = torch.empty(e, n, k // 2, device="cuda", dtype=fp4.PACKED)
                s = torch.empty(e, n, k // fp4.GROUP, device="cuda", dtype=torch.uint8)
                for j in range(e):
                    fp4.load_float(w[j], s[j], torch.randn(n, k, device="cuda", generator=g) * k**-0.5)
                return w, s

            (w13, s13), (w2, s2) = packed(2 * i, d), packed(d, i)
            cache[shape] = (w13, w2, s13, s2)
        if not tiled:
            return cache[shape]
        return fp4.tile_layer(*cache[shape])

    return get


def _routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g, device="cuda").argsort(-1)[:, :k]
    return torch.rand(tokens, k, generator=g, device="cuda"), ids


@pytest.mark.parametrize(
    "shape,tokens,limit",
    [("v2lite", 1, None), ("v2lite", 64, None), ("v2lite", 128, None), ("v2lite", 4096, None),
     ("v3", 1, None), ("v3", 128, None), ("v3", 2048, None), ("ragged", 33, 0.7)],
)  # fmt: skip
def test_fused_moe_matches_reference(weights, shape, tokens, limit):
    e, k, d, i = SHAPES[shape]
    w13, w2 = weights(shape)
    x = torch.randn(tokens, d, device="cuda").to(torch.bfloat16)
    topk_w, ids = _routing(tokens, e, k, seed=tokens)
    got = _impl("triton")(x, w13, w2, topk_w, ids, limit)
    want = _impl("reference")(x, w13, w2, topk_w, ids, limit)
    ratio = close_ratio(got, want, *TOLERANCE[torch.bfloat16])
    import triton.testing

    ms = triton.testing.do_bench(lambda: _impl("triton")(x, w13, w2, topk_w, ids, limit), warmup=5, rep=20)
    touched = ids.unique().numel()
    gbytes = touched * 3 * d * i * 2 / 1e9
    print(
        f"\n  {shape} T={tokens}: {ratio:.3f}x tol, {ms * 1e3:.1f} us, {touched} experts, "
        f"{gbytes / ms * 1e3:.0f} GB/s of expert weights, {2 * tokens * k * 3 * d * i / ms / 1e9:.1f} TFLOP/s"
    )
    assert ratio <= 1.0


def _fp8_tolerance(want: torch.Tensor) -> tuple[float, float]:
    """Both sides quantize x and h per 128-group the same way; they differ where an e4m3 rounding flips
    (x / scale an ulp apart in Triton's division; h a bf16 ulp apart from the accumulation order), a
    step of 1/8 of one activation, ~0.1% of an output it feeds: 1% of the largest output covers many."""
    return 1e-2 * want.abs().max().item(), 1.6e-2


@pytest.mark.parametrize(
    "shape,tokens,limit",
    [("v3", 1, None), ("v3", 64, None), ("v3", 4096, None), ("v2lite", 128, None), ("ragged", 33, 0.7)],
)
def test_fused_moe_fp8_matches_reference(fp8_weights, shape, tokens, limit):
    e, k, d, i = SHAPES[shape]
    w13, w2, s13, s2 = fp8_weights(shape)
    x = torch.randn(tokens, d, device="cuda").to(torch.bfloat16)
    topk_w, ids = _routing(tokens, e, k, seed=tokens)
    scales = dict(w13_scale=s13, w2_scale=s2)
    got = _impl("triton")(x, w13, w2, topk_w, ids, limit, **scales)
    want = _impl("reference")(x, w13, w2, topk_w, ids, limit, **scales)
    ratio = close_ratio(got, want, *_fp8_tolerance(want))
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    import triton.testing

    ms = triton.testing.do_bench(
        lambda: _impl("triton")(x, w13, w2, topk_w, ids, limit, **scales), warmup=5, rep=20
    )
    touched = ids.unique().numel()
    gbytes = touched * 3 * d * i / 1e9  # e4m3: a byte per weight (the scales are 1/16384 of that)
    print(
        f"\n  fp8 {shape} T={tokens}: {ratio:.3f}x tol, rel. error {rel:.1e}, {ms * 1e3:.1f} us, {touched} experts, "
        f"{gbytes / ms * 1e3:.0f} GB/s of expert weights, {2 * tokens * k * 3 * d * i / ms / 1e9:.1f} TFLOP/s"
    )
    assert got.dtype == torch.bfloat16 and ratio <= 1.0 and rel <= 1e-2


@pytest.mark.parametrize(
    "shape,tokens,limit",
    [("v4flash", 1, 10.0), ("v4flash", 64, 10.0), ("v4flash", 512, None), ("v4flash", 4096, None),
     ("ragged32", 33, 0.7)],
)  # fmt: skip
@pytest.mark.parametrize(
    "step,tiled", [("values", False), ("scaled", False), ("scaled", True), ("mma", True)]
)
def test_fused_moe_fp4_matches_reference(fp4_weights, shape, tokens, limit, step, tiled):
    """W4A16: both sides multiply bf16 activations by the same dequantized weights (exact in bf16);
    only the float32 accumulation order differs, so the bf16 tolerance holds. Every form of the K step
    (`MoEConfig.fp4_step`), at `choose_config`'s FP4 tiles; the mma kernels read the tiled form (where its
    shape has none, "ragged32", the op runs "scaled")."""
    from dataclasses import replace

    from runtime.gpu.kernels.fused_moe.triton import choose_config

    e, k, d, i = SHAPES[shape]
    w13, w2, s13, s2 = fp4_weights(shape, tiled and fp4.tileable(d, i) and fp4.tileable(2 * i, d))
    x = torch.randn(tokens, d, device="cuda").to(torch.bfloat16)
    topk_w, ids = _routing(tokens, e, k, seed=tokens)
    cfg = replace(choose_config(tokens * k, e, x.device, x.dtype, fp4=True), fp4_step=step)
    scales = dict(w13_scale=s13, w2_scale=s2)
    got = _impl("triton")(x, w13, w2, topk_w, ids, limit, **scales, config=cfg)
    want = _impl("reference")(x, w13, w2, topk_w, ids, limit, **scales)
    ratio = close_ratio(got, want, *TOLERANCE[torch.bfloat16])
    import triton.testing

    ms = triton.testing.do_bench(
        lambda: _impl("triton")(x, w13, w2, topk_w, ids, limit, **scales, config=cfg), warmup=5, rep=20
    )
    touched = ids.unique().numel()
    gbytes = touched * 3 * d * i * (0.5 + 1 / fp4.GROUP) / 1e9  # half a byte per weight, a scale per 32
    print(
        f"\n  fp4 {shape} T={tokens} {step}{' tiled' if fp4.is_tiled(w13) else ''}: "
        f"{ratio:.3f}x tol, {ms * 1e3:.1f} us, {touched} experts, "
        f"{gbytes / ms * 1e3:.0f} GB/s of expert weights, {2 * tokens * k * 3 * d * i / ms / 1e9:.1f} TFLOP/s"
    )
    assert got.dtype == torch.bfloat16 and ratio <= 1.0


@pytest.mark.parametrize("stages,sub", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("block_m", [8, 16, 32])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_fp4_mma_every_code_and_scale(tokens, block_m, stages, sub, monkeypatch):
    """The mma kernels (`tilelang_fp4`) against the reference on every e2m1 code and scales from 2^-27
    to 2^13 (past 2: the kernel's second multiply), at each block size they take, V4's SwiGLU clamp on;
    one or two steps in flight, one or two scale groups a thread a step."""
    from dataclasses import replace

    from runtime.gpu.kernels.fused_moe import tilelang_fp4
    from runtime.gpu.kernels.fused_moe.triton import choose_config

    monkeypatch.setattr(tilelang_fp4, "STAGES", stages)
    monkeypatch.setattr(tilelang_fp4, "SUB", sub)
    e, k, d, i = 8, 2, 256, 128 * sub  # K of both matmuls a multiple of 128 SUB
    g = torch.Generator(device="cuda").manual_seed(block_m + tokens)
    w13 = torch.randint(0, 256, (e, 2 * i, d // 2), device="cuda", dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (e, d, i // 2), device="cuda", dtype=torch.uint8, generator=g)
    s13 = torch.randint(100, 141, (e, 2 * i, d // 32), device="cuda", dtype=torch.uint8, generator=g)
    s2 = torch.randint(112, 123, (e, d, i // 32), device="cuda", dtype=torch.uint8, generator=g)
    w13, w2, s13, s2 = fp4.tile_layer(w13, w2, s13, s2)  # the form the mma kernels read
    x = (torch.randn(tokens, d, device="cuda", generator=g) * 2.0**-14).to(torch.bfloat16)
    topk_w, ids = _routing(tokens, e, k, seed=tokens)
    cfg = replace(choose_config(tokens * k, e, x.device, x.dtype, fp4=True), block_m=block_m, fp4_step="mma")
    assert tilelang_fp4.supported(x, w13, w2, (s13, s2), block_m)
    scales = dict(w13_scale=s13, w2_scale=s2)
    got = _impl("triton")(x, w13, w2, topk_w, ids, 10.0, **scales, config=cfg)
    want = _impl("reference")(x, w13, w2, topk_w, ids, 10.0, **scales)
    assert want.abs().amax() > 1.0  # outputs well above the absolute tolerance
    assert got.dtype == torch.bfloat16 and close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("tokens", [1, 24])
def test_fused_moe_replays_in_a_cuda_graph_on_new_routing(weights, fp8_weights, fp4_weights, tokens, fmt):
    e, k, d, i = SHAPES["v2lite"]
    if fmt == "bf16":
        (w13, w2), scales = weights("v2lite"), {}
    else:
        w13, w2, s13, s2 = fp8_weights("v2lite") if fmt == "fp8" else fp4_weights("v2lite", tiled=True)
        scales = dict(w13_scale=s13, w2_scale=s2)
    fn = _impl("triton")
    x = torch.randn(tokens, d, device="cuda").to(torch.bfloat16)
    topk_w, ids = _routing(tokens, e, k, seed=1)
    fn(x, w13, w2, topk_w, ids, **scales)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises on a host sync
        out = fn(x, w13, w2, topk_w, ids, **scales)
    for seed in (2, 3):
        new_w, new_ids = _routing(tokens, e, k, seed)
        x.copy_(torch.randn_like(x))
        topk_w.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        want = _impl("reference")(x, w13, w2, topk_w, ids, **scales)
        tol = _fp8_tolerance(want) if fmt == "fp8" else TOLERANCE[torch.bfloat16]
        assert close_ratio(out, want, *tol) <= 1.0


@pytest.mark.parametrize(
    "tokens,experts,k",
    [(1, 64, 6), (128, 64, 6), (512, 256, 8), (682, 64, 6), (1024, 64, 6), (1024, 256, 8), (2730, 64, 6)],
)
@pytest.mark.parametrize("form", ["one_program", "tiled", "fast"])
def test_triton_layouts_equal_torch_layout(tokens, experts, k, form):
    from runtime.gpu.kernels.fused_moe import triton_layout
    from runtime.gpu.kernels.fused_moe.layout import moe_layout

    fn = {"one_program": triton_layout.moe_layout_triton, "tiled": triton_layout.moe_layout_tiled,
          "fast": triton_layout.moe_layout_fast}[form]  # fmt: skip
    ids = _routing(tokens, experts, k, seed=tokens)[1]
    ids[: tokens // 2, 0] = 3  # one crowded expert
    for block_m in (16, 32, 64):
        a, b = moe_layout(ids, experts, block_m), fn(ids, experts, block_m)
        for f in ("sorted_pairs", "block_expert", "num_rows"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (f, block_m)


@pytest.mark.parametrize(
    "tokens,experts,k,groups,topk_group,scoring,bias",
    [(1, 256, 8, 8, 4, "sigmoid", True), (4096, 256, 8, 8, 4, "sigmoid", True), (128, 64, 6, 1, 1, "sigmoid", True),
     (64, 160, 6, 8, 3, "softmax", False), (64, 256, 6, 1, 1, "sqrtsoftplus", True)],
)  # fmt: skip
def test_moe_route_matches_reference(tokens, experts, k, groups, topk_group, scoring, bias):
    """Same experts (as sets) and weights; torch.topk's order is unspecified."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=g, device="cuda") * 3
    b = torch.rand(experts, generator=g, device="cuda") * 0.4 - 0.2 if bias else None
    args = (logits, b, k, groups, topk_group, scoring, True, 2.5)
    impls = {i.name: i.load() for i in registry.op("moe_route").implementations()}
    w_ref, ids_ref = impls["reference"](*args)
    w, ids = impls["triton"](*args)
    ids_ref, o_ref = ids_ref.sort(-1)
    ids, o = ids.sort(-1)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.gather(1, o), w_ref.gather(1, o_ref), atol=1e-6, rtol=1e-5)

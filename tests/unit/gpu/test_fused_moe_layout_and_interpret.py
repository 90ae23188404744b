"""The MoE ops on the CPU (`fused_moe`, `moe_route`): the device-side layout puts every (token, expert)
pair in exactly one row of a block of its expert; the reference equals a loop over tokens (FP8 experts:
over dequantized weights and per-token quantized activations; FP4 experts: the float path on their
dequantized weights); the Triton kernels (bf16, FP8 and FP4 experts,
one-program layout, router) match the references under the Triton interpreter (in a subprocess, as in
test_kernels_interpret.py: this file run as a script with TRITON_INTERPRET=1 prints {case: closeness
ratio}). Skipped without triton."""

from __future__ import annotations

import functools

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.fp8_gemm.reference import act_quant, dequant_act
from runtime.gpu.kernels.fused_moe import reference
from runtime.gpu.kernels.fused_moe.layout import max_blocks, moe_layout
from runtime.gpu.kernels.silu_and_mul.reference import silu_and_mul
from runtime.gpu.kernels.testing import InterpreterCases
from runtime.gpu.quant import fp4
from runtime.gpu.quant.fp8 import dequantize, quantize


def _random_moe(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]
    if tokens > 2:
        # a crowded expert next to sparse and empty ones (a repeated expert in a row is fine here)
        ids[: tokens // 2, 0] = 1
    weights = torch.rand(tokens, k, generator=g)
    return x, w13, w2, weights, ids


def _random_fp8_moe(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype, seed: int):
    """x, (w13, w2 e4m3), weights, ids, (w13_scale, w2_scale): DeepSeek-V3's 128x128 block format. The
    weights' magnitudes vary 16x between blocks, so a scale read from the wrong block shows."""
    x, w13, w2, weights, ids = _random_moe(tokens, experts, k, hidden, inter, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 1)

    def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = 4.0 ** (
            torch.rand(w.shape[0], -(-w.shape[1] // 128), -(-w.shape[2] // 128), generator=g) * 2 - 1
        )
        spread = blocks.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : w.shape[1], : w.shape[2]]
        q, scale = zip(*(quantize(we, (128, 128)) for we in w * spread), strict=True)  # expert by expert
        return torch.stack(q), torch.stack(scale)

    (w13, s13), (w2, s2) = fp8(w13), fp8(w2)
    return x.to(dtype), w13, w2, weights, ids, s13, s2


def _random_fp4_moe(tokens: int, experts: int, k: int, hidden: int, inter: int, dtype, seed: int):
    """x, (w13, w2 packed uint8), weights, ids, (w13_scale, w2_scale UE8M0 bytes): DeepSeek-V4's routed
    experts. Magnitudes vary 16x between groups of 32, so a scale read from the wrong group shows."""
    x, w13, w2, weights, ids = _random_moe(tokens, experts, k, hidden, inter, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 2)

    def packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spread = 4.0 ** (torch.rand(*w.shape[:-1], w.shape[-1] // fp4.GROUP, generator=g) * 2 - 1)
        q, s = fp4.quantize(w * spread.repeat_interleave(fp4.GROUP, -1))
        return q.view(fp4.PACKED), s.view(torch.uint8)

    (w13, s13), (w2, s2) = packed(w13), packed(w2)
    return x.to(dtype), w13, w2, weights, ids, s13, s2


@pytest.mark.parametrize(
    "tokens,experts,k,block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (100, 64, 6, 32), (5, 3, 3, 4)]
)
def test_layout_puts_every_pair_once_in_a_block_of_its_expert(tokens, experts, k, block_m):
    ids = _random_moe(tokens, experts, k, 4, 4, torch.float32, seed=tokens)[4]
    lay = moe_layout(ids, experts, block_m)
    pairs, flat = tokens * k, ids.reshape(-1)
    rows = int(lay.num_rows)
    assert lay.max_blocks == max_blocks(pairs, experts, block_m) and rows % block_m == 0
    assert rows <= lay.max_blocks * block_m
    used = lay.sorted_pairs[:rows]
    real = used[used < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair exactly once
    assert (lay.sorted_pairs[rows:] == pairs).all()  # past num_rows: padding only
    block_of = torch.arange(rows) // block_m
    is_real = used < pairs
    assert (flat[used[is_real].long()] == lay.block_expert[block_of[is_real]].long()).all()
    counts = torch.bincount(flat, minlength=experts)
    assert rows == int(((counts + block_m - 1) // block_m * block_m).sum())


def _loop_over_tokens(x, w13, w2, weights, ids, limit=None):
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gu = w13[e] @ x[t]
            h = silu_and_mul(gu[:inter], gu[inter:], limit=limit)
            out[t] += weights[t, j] * (w2[e] @ h)
    return out


@pytest.mark.parametrize("limit", [None, 0.3])
def test_reference_equals_a_loop_over_tokens(limit):
    x, w13, w2, weights, ids = _random_moe(23, 6, 3, 16, 8, torch.float32, seed=1)
    got = reference.fused_moe(x, w13, w2, weights, ids, limit)
    torch.testing.assert_close(got, _loop_over_tokens(x, w13, w2, weights, ids, limit), atol=1e-5, rtol=1e-5)


def test_fp8_reference_equals_a_loop_over_tokens_on_dequantized_weights():
    """Each token's x and each SwiGLU output quantized per 128-group, then float32 matmuls on the
    dequantized values (ragged: D = 200, I = 96, so the up rows start inside a scale block)."""
    x, w13, w2, weights, ids, s13, s2 = _random_fp8_moe(7, 4, 2, 200, 96, torch.float32, seed=4)
    got = reference.fused_moe(x, w13, w2, weights, ids, 0.5, w13_scale=s13, w2_scale=s2)
    w13d, w2d = dequantize(w13, s13, (128, 128)), dequantize(w2, s2, (128, 128))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        xq = dequant_act(*act_quant(x[t : t + 1]))[0]
        for j, e in enumerate(ids[t].tolist()):
            gu = w13d[e] @ xq
            h = silu_and_mul(gu[:96], gu[96:], limit=0.5)
            out[t] += weights[t, j] * (w2d[e] @ dequant_act(*act_quant(h[None]))[0])
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)


def test_fp8_reference_is_close_to_the_bf16_path_on_dequantized_weights():
    """The activation quantization costs what e4m3 rounding costs, no more: 3 mantissa bits round each
    value by up to 1/16 of itself, ~3.6% rms, for x and again for h: ~5% of the output's norm."""
    x, w13, w2, weights, ids, s13, s2 = _random_fp8_moe(16, 4, 2, 256, 128, torch.bfloat16, seed=5)
    got = reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    w13d, w2d = dequantize(w13, s13, (128, 128)), dequantize(w2, s2, (128, 128))
    want = reference.fused_moe(x, w13d.to(torch.bfloat16), w2d.to(torch.bfloat16), weights, ids)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert got.dtype == torch.bfloat16 and 0.02 < rel < 0.1, rel


def test_fp8_reference_needs_both_scales_on_the_block_grid():
    x, w13, w2, weights, ids, s13, s2 = _random_fp8_moe(2, 4, 2, 256, 128, torch.bfloat16, seed=6)
    with pytest.raises(AssertionError):
        reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13)
    with pytest.raises(AssertionError):
        reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2[:, :1])
    x, w13, w2, weights, ids, s13, s2 = _random_fp4_moe(2, 4, 2, 64, 32, torch.bfloat16, seed=6)
    with pytest.raises(AssertionError):  # FP4: one scale byte per row and 32 along K
        reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2[..., :0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_reference_is_the_float_path_on_the_dequantized_weights(dtype):
    """W4A16: nothing is quantized but the weights, whose dequantized values bf16 holds exactly."""
    x, w13, w2, weights, ids, s13, s2 = _random_fp4_moe(11, 4, 2, 64, 96, dtype, seed=7)
    got = reference.fused_moe(x, w13, w2, weights, ids, 0.5, w13_scale=s13, w2_scale=s2)
    w13d, w2d = fp4.dequantize(w13, s13), fp4.dequantize(w2, s2)
    assert torch.equal(w13d.to(dtype).float(), w13d) and w13d.shape == (4, 192, 64)
    assert torch.equal(got, reference.fused_moe(x, w13d.to(dtype), w2d.to(dtype), weights, ids, 0.5))


def test_fp4_reference_reads_the_tiled_form_as_the_row_major_one():
    x, w13, w2, weights, ids, s13, s2 = _random_fp4_moe(7, 4, 2, 128, 256, torch.float32, seed=8)
    tiled = fp4.tile_layer(w13, w2, s13, s2)
    assert tiled[0].shape == (4, 512 // 16, 64 // 64, 16, 64) and fp4.stacked_shape(tiled[0]) == w13.shape
    assert all(torch.equal(fp4.untile_experts(t), w) for t, w in zip(tiled, (w13, w2, s13, s2), strict=True))
    want = reference.fused_moe(x, w13, w2, weights, ids, 0.5, w13_scale=s13, w2_scale=s2)
    got = reference.fused_moe(x, tiled[0], tiled[1], weights, ids, 0.5, w13_scale=tiled[2], w2_scale=tiled[3])
    assert torch.equal(got, want)
    with pytest.raises(AssertionError):  # all four in one form
        reference.fused_moe(x, tiled[0], tiled[1], weights, ids, w13_scale=s13, w2_scale=tiled[3])


def test_routed_experts_tile_fp4_in_place_and_compute_the_same():
    """`RoutedExperts.tile_fp4` (run by V4's `prepare_for_serving`): the same storage and outputs, every
    tensor 5-D; a shape the tiles do not divide stays row-major."""
    from runtime.gpu.layers.moe import RoutedExperts

    experts = RoutedExperts(4, 128, 256, swiglu_limit=0.5, weight_format="fp4")
    experts.init_dummy(torch.Generator().manual_seed(0), 0.05)
    x, _, _, weights, ids = _random_moe(5, 4, 2, 128, 8, torch.float32, seed=9)
    want = experts(x, weights, ids)
    storage = experts.gate_up_proj.data.data_ptr()
    experts.tile_fp4()
    assert all(fp4.is_tiled(getattr(experts, n)) for n in experts._QUANTIZED_NAMES)
    assert experts.gate_up_proj.data.data_ptr() == storage and fp4.stacked_shape(experts.down_proj) == (
        4,
        128,
        128,
    )
    assert torch.equal(experts(x, weights, ids), want)
    experts.tile_fp4()  # once only
    with pytest.raises(AssertionError):  # nothing loads into tiled experts
        experts.checkpoint_slice(0, "down_proj")
    ragged = RoutedExperts(4, 96, 64, weight_format="fp4")
    ragged.tile_fp4()
    assert not fp4.is_tiled(ragged.gate_up_proj)


def test_reference_rounds_like_the_kernels_in_bfloat16():
    """bf16 in, bf16 out, float32 math: within a bf16 ulp or two of the float32 result."""
    x, w13, w2, weights, ids = _random_moe(19, 8, 2, 32, 16, torch.bfloat16, seed=2)
    got = reference.fused_moe(x, w13, w2, weights, ids)
    want = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("op", ["fused_moe", "moe_route"])
def test_registry_picks_the_reference_on_the_cpu(op):
    assert [i.name for i in registry.op(op).implementations()] == ["triton", "reference"]
    assert registry.op(op).select("cpu").name == "reference"


def test_empty_batch():
    x, w13, w2, weights, ids = _random_moe(0, 4, 2, 8, 4, torch.float32, seed=3)
    assert reference.fused_moe(x, w13, w2, weights, ids).shape == (0, 8)
    x, w13, w2, weights, ids, s13, s2 = _random_fp8_moe(0, 4, 2, 256, 128, torch.bfloat16, seed=3)
    assert reference.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2).shape == (0, 256)


# ------------------------------------------------------------------ Triton under the interpreter

KERNEL_CASES = {
    # tokens, experts, k, hidden, inter, dtype, swiglu limit
    "fp32_decode_batch1": (1, 8, 3, 48, 40, "float32", None),
    "fp32_ragged_dims_v4_limit": (9, 4, 2, 40, 24, "float32", 0.5),
    "bf16_crowded_and_empty_experts": (37, 8, 3, 64, 48, "bfloat16", None),
    "fp16_more_experts_than_pairs": (3, 64, 6, 32, 32, "float16", None),
}
_TOL = {"float32": (1e-4, 1e-4), "float16": (2e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}


def _run_case(tokens, experts, k, hidden, inter, dtype, limit) -> float:
    from runtime.gpu.kernels.fused_moe import triton as fused_triton
    from runtime.gpu.kernels.testing import close_ratio

    x, w13, w2, weights, ids = _random_moe(tokens, experts, k, hidden, inter, getattr(torch, dtype), tokens)
    got = fused_triton.fused_moe(x, w13, w2, weights, ids, limit)
    return close_ratio(got, reference.fused_moe(x, w13, w2, weights, ids, limit), *_TOL[dtype])


FP8_CASES = {
    # tokens, experts, k, hidden, inter, swiglu limit: bf16 x, e4m3 experts with 128x128 block scales
    "fp8_decode_batch1": (1, 4, 2, 256, 128, None),
    "fp8_crowded_expert_two_k_groups": (9, 4, 2, 256, 128, None),
    "fp8_ragged_dims_v4_limit": (5, 4, 2, 200, 96, 0.5),  # ragged K groups; up rows start mid-block
}


def _run_fp8_case(tokens, experts, k, hidden, inter, limit) -> float:
    """Both sides quantize x and h identically; the tolerance covers accumulation order, and a rare
    e4m3 step where it flips a rounding of h (as on the GPU)."""
    from runtime.gpu.kernels.fused_moe import triton as fused_triton
    from runtime.gpu.kernels.testing import close_ratio

    x, w13, w2, weights, ids, s13, s2 = _random_fp8_moe(
        tokens, experts, k, hidden, inter, torch.bfloat16, tokens
    )
    got = fused_triton.fused_moe(x, w13, w2, weights, ids, limit, w13_scale=s13, w2_scale=s2)
    want = reference.fused_moe(x, w13, w2, weights, ids, limit, w13_scale=s13, w2_scale=s2)
    return close_ratio(got, want, 2e-3 * want.abs().max().item(), 1.6e-2)


FP4_CASES = {
    # tokens, experts, k, hidden, inter, dtype, swiglu limit: packed e2m1 experts, UE8M0 scales per 32
    "fp4_fp32_decode_batch1": (1, 4, 2, 64, 32, "float32", None),
    "fp4_bf16_crowded_expert_v4_limit": (9, 4, 2, 96, 64, "bfloat16", 0.5),
}


FP4_STEP_CASES = {  # the same through tl.dot_scaled (MoEConfig.fp4_step "scaled", the CUDA default), K by 64
    "fp4_dot_scaled_bf16_ragged_k_v4_limit": (9, 4, 2, 96, 64, "bfloat16", 0.5, "scaled"),  # K 96: 1.5 steps
    "fp4_dot_scaled_bf16_decode_batch1": (1, 4, 2, 64, 32, "bfloat16", None, "scaled"),
}

FP4_TILED_CASES = {  # the tiled form (`fp4.tile_experts`, what RoutedExperts keeps): K by 64, half a tile a step
    "fp4_tiled_dot_scaled_bf16_v4_limit": (9, 4, 2, 256, 128, "bfloat16", 0.5, "scaled", True),
    "fp4_tiled_values_fp32": (3, 4, 2, 128, 256, "float32", None, None, True),
}


def _run_fp4_case(tokens, experts, k, hidden, inter, dtype, limit, step=None, tiled=False) -> float:
    """The kernels see exactly the reference's dequantized weights: only accumulation order differs."""
    from runtime.gpu.kernels.fused_moe import triton as fused_triton
    from runtime.gpu.kernels.testing import close_ratio

    x, w13, w2, weights, ids, s13, s2 = _random_fp4_moe(
        tokens, experts, k, hidden, inter, getattr(torch, dtype), tokens
    )
    want = reference.fused_moe(x, w13, w2, weights, ids, limit, w13_scale=s13, w2_scale=s2)
    if tiled:
        w13, w2, s13, s2 = fp4.tile_layer(w13, w2, s13, s2)
    config = fused_triton.MoEConfig(16, 32, 64, 1, 1, fp4_step=step) if step else None
    got = fused_triton.fused_moe(x, w13, w2, weights, ids, limit, w13_scale=s13, w2_scale=s2, config=config)
    return close_ratio(got, want, *_TOL[dtype])


LAYOUT_CASES = {  # tokens, experts, k, block_m
    "layout_triton_equals_torch_v2lite_decode": (1, 64, 6, 16),
    "layout_triton_equals_torch_crowded": (37, 8, 3, 16),
    "layout_triton_equals_torch_v3_batch200": (200, 256, 8, 16),
    "layout_triton_equals_torch_tiny_blocks": (5, 3, 3, 4),
    "layout_tiled_equals_torch_v2lite_verify": (64, 64, 6, 32),  # 6 tiles of 64 pairs
    "layout_tiled_equals_torch_one_tile": (3, 64, 6, 16),
    "layout_tiled_equals_torch_v3_crowded": (50, 256, 8, 16),  # 13 tiles, one crowded expert
}


def _run_layout_case(tokens, experts, k, block_m) -> float:
    """0.0 when both Triton layouts (one program; a program per tile) equal the torch-ops layout bit for
    bit, else inf."""
    from runtime.gpu.kernels.fused_moe.triton_layout import moe_layout_tiled, moe_layout_triton

    ids = _random_moe(tokens, experts, k, 4, 4, torch.float32, seed=tokens)[4]
    ids[: tokens // 2, 0] = experts - 1  # one crowded expert
    want = moe_layout(ids, experts, block_m)
    for got in (moe_layout_triton(ids, experts, block_m), moe_layout_tiled(ids, experts, block_m)):
        fields = ("sorted_pairs", "block_expert", "num_rows")
        if not all(torch.equal(getattr(want, f), getattr(got, f)) for f in fields):
            return float("inf")
    return 0.0


ROUTE_CASES = {  # tokens, experts, top_k, groups, topk_group, scoring, bias, normalize
    "route_v3_grouped_sigmoid_bias": (9, 256, 8, 8, 4, "sigmoid", True, True),
    "route_v2lite_as_v3_flat": (7, 64, 6, 1, 1, "sigmoid", True, False),
    "route_v2_softmax_groups_no_bias": (5, 16, 2, 4, 1, "softmax", False, False),
    "route_v2_group_limited_greedy": (5, 160, 6, 8, 3, "softmax", False, False),
    "route_v2lite_greedy": (7, 64, 6, 1, 1, "softmax", False, False),
    "route_v4_sqrtsoftplus": (6, 12, 2, 1, 1, "sqrtsoftplus", True, True),
    "route_odd_groups_top1": (4, 12, 1, 3, 2, "softmax", False, True),
}


def _run_route_case(tokens, experts, k, groups, topk_group, scoring, bias, normalize) -> float:
    """Error ratio of the weights, matched by expert id (top-k order is unspecified); inf when the
    chosen experts differ."""
    from runtime.gpu.kernels.moe_route import reference as route_ref
    from runtime.gpu.kernels.moe_route import triton as route_triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(tokens * experts)
    logits = torch.randn(tokens, experts, generator=g) * 3
    b = torch.rand(experts, generator=g) * 0.4 - 0.2 if bias else None
    args = (k, groups, topk_group, scoring, normalize, 2.5)
    (w_ref, ids_ref), (w, ids) = (
        route_ref.moe_route(logits, b, *args),
        route_triton.moe_route(logits, b, *args),
    )
    ids_ref, o_ref = ids_ref.sort(-1)
    ids, o = ids.sort(-1)
    if not torch.equal(ids, ids_ref):
        return float("inf")
    return close_ratio(w.gather(1, o), w_ref.gather(1, o_ref), 1e-6, 1e-5)


CASES = InterpreterCases()
for _table, _run in (
    (KERNEL_CASES, _run_case),
    (FP8_CASES, _run_fp8_case),
    (FP4_CASES, _run_fp4_case),
    (FP4_STEP_CASES, _run_fp4_case),
    (FP4_TILED_CASES, _run_fp4_case),
    (LAYOUT_CASES, _run_layout_case),
    (ROUTE_CASES, _run_route_case),
):
    for _name, _args in _table.items():
        CASES.add(_name, functools.partial(_run, *_args))


test_triton_matches_torch_under_interpreter = CASES.pytest_test(__file__)


if __name__ == "__main__":
    CASES.main()

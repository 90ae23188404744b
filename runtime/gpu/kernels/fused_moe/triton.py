"""Routed DeepSeekMoE experts in two Triton launches over the block-padded layout (`layout.py`).

1. gate/up + SwiGLU: one program per (block of `block_m` sorted pairs, column tile of I). The block's
   rows are gathered from x through the pair -> token map (no permuted copy of x); gate and up columns
   of the expert are two accumulators over the same x tile, and the epilogue writes silu(g) * u
   (V4's clamp first) as the down projection's input H [rows, I], in x's dtype.
2. down + weighting: one program per (block, column tile of D) over H; the epilogue multiplies each row
   by its routing weight and stores it at its pair's place (the unpermute is the store), Y [T*k, D].

The layout comes from Triton programs for decode- and verify-sized batches (`triton_layout.py`), from
torch ops past that. The sum over the k experts of a token is one torch reduction of Y viewed [T, k, D] (float32
accumulation, deterministic: no atomics). Nothing reads the device on the host, so a decode step that
calls this can be captured in a CUDA graph: every shape and grid follows from T, k, E and the config.
Block sizes follow the mean rows per expert (16 for decode batches, 32 for verify steps, 64 past
that); the verify tiles come from `benchmarks/kernels/fused_moe_tune.py`, the others are untuned.

FP8 experts (W8A8, `w13_scale`/`w2_scale` given; a constexpr branch, so the bf16 kernels are unchanged):
each K step is one 128-group (block_k = 128): an fp8 `tl.dot` of the e4m3 activation and weight tiles,
multiplied by the tile rows' activation scales and the columns' weight block scales, then added to the
float32 accumulators (the promotion of `fp8_gemm/triton.py`). The activations are quantized per token
and 128-group by the `fp8_act_quant` op in two launches of their own: x before the gate/up kernel (the
kernel then gathers e4m3 rows and their scales), and H (still written in x's dtype, as the reference
rounds it) between the two kernels. Quantizing in the GEMM kernels' registers instead would skip these
launches, but every program would redo it (x once per column tile of I, H once per column tile of D:
56x at V3) on the CUDA cores inside the K loop, the Triton interpreter casts float32 to e4m3 wrongly,
and the separate quantizer is the one whose rounding is tested against `act_quant`.

FP4 experts (W4A16, DeepSeek-V4's routed experts): two kernels of their own over the same layout,
`triton_fp4.py`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import triton
import triton.language as tl

from runtime import envs
from runtime.gpu.kernels.common import dot_precision
from runtime.gpu.kernels.fp8_gemm import FP8_ACT_QUANT
from runtime.gpu.kernels.fp8_gemm.reference import GROUP
from runtime.gpu.kernels.fused_moe import tilelang_fp4
from runtime.gpu.kernels.fused_moe.layout import MoELayout
from runtime.gpu.kernels.fused_moe.reference import expert_format
from runtime.gpu.kernels.fused_moe.triton_fp4 import FP4_DEFAULT_STEP, FP4_STEPS, fp4_step, launch_fp4
from runtime.gpu.kernels.fused_moe.triton_layout import block_tile, moe_layout_fast, store_swiglu
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand
from runtime.gpu.quant import fp4


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int  # columns of Y per down program; gate/up programs take block_n // 2 of each half
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    fp4_step: str = "values"  # FP4 experts: the K step's form, triton_fp4.FP4_STEPS


@cache
def _fp4_decode_tile() -> MoEConfig:
    """The FP4 experts' tile at up to 16 rows an expert: $CONDUIT_FP4_MOE_DECODE_TILE (comparisons),
    else fused_moe_tune's best at V4-Flash's experts and 64 tokens (H100)."""
    forced = envs.fp4_moe_decode_tile()
    return MoEConfig(*forced) if forced else MoEConfig(16, 128, 64, num_warps=4, num_stages=3)


@cache
def _fp4_step() -> str:
    """The FP4 experts' K-step form, read once: $CONDUIT_FP4_MOE_STEP (comparisons), else the default."""
    step = envs.fp4_moe_step() or FP4_DEFAULT_STEP
    if step not in FP4_STEPS:
        raise ValueError(f"CONDUIT_FP4_MOE_STEP={step}: choose from {', '.join(FP4_STEPS)}")
    return step


def choose_config(
    num_pairs: int, num_experts: int, device: torch.device, dtype: torch.dtype, fp8: bool = False,
    fp4: bool = False,
) -> MoEConfig:  # fmt: skip
    """From the mean rows per expert, a host-side number: the same for every replay of a batch size.
    float32 (the parity tests) halves the stages: its tiles take twice the shared memory. FP8: the
    same tiles with block_k = 128, one scale group per K step (e4m3 tiles take half the bytes of bf16's).
    FP4: the K step's form from `_fp4_step` (read once), and tiles of their own at decode sizes and past
    64 rows an expert (prefill)."""
    if device.type != "cuda":  # the interpreter: small tiles
        return MoEConfig(16, 32, GROUP if fp8 else 32, num_warps=1, num_stages=1)
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 16:
        cfg = MoEConfig(16, 64, 128, num_warps=4, num_stages=4)
    elif per_expert <= 48:  # verify steps: 32 x 128 tiles, K by 128 (fused_moe_tune: 5.6% over 32 x 64 x 64)
        cfg = MoEConfig(32, 128, 128, num_warps=4, num_stages=3)
    else:
        cfg = MoEConfig(64, 128, 64, num_warps=4, num_stages=3)
    if fp8:
        return replace(cfg, block_k=GROUP)
    if fp4:
        if per_expert <= 16:
            cfg = _fp4_decode_tile()
        elif per_expert > 64:  # fused_moe_tune at 4,096 tokens (96 an expert), H100: 6.30 against 8.13 ms
            cfg = MoEConfig(128, 128, 64, num_warps=4, num_stages=3)
        cfg = replace(cfg, fp4_step=_fp4_step())
    return replace(cfg, num_stages=2) if dtype == torch.float32 else cfg


@triton.jit
def _k_step(
    acc, a, w, a_s_ptrs, w_s_ptrs, valid, mask_n,
    FP8: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """acc + a @ w for one K step of a [BLOCK_M, BLOCK_N] tile. FP8: one 128-group, e4m3 dots promoted by
    the rows' activation scales (a_s_ptrs) and the columns' weight block scales (w_s_ptrs); else a dot
    accumulating into acc."""
    if FP8:
        a_s = tl.load(a_s_ptrs, mask=valid, other=0.0)[:, None]
        w_s = tl.load(w_s_ptrs, mask=mask_n, other=0.0)[None, :]
        return acc + tl.dot(a, w) * a_s * w_s
    else:
        return tl.dot(dot_operand(a, DOT_F32), dot_operand(w, DOT_F32), acc, input_precision=DOT_PREC)


@triton.jit
def _gate_up_swiglu(
    X, W, H, Pairs, BlockExpert, NumRows, XS, WS,
    num_pairs, N, K, limit,
    stride_xm, stride_we, stride_wn, stride_hm, stride_xsm, stride_xsk, stride_wse, stride_wsn,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """FP8: X is e4m3 with per-(token, 128-group) scales XS; W e4m3 with 128x128 block scales WS
    [E, 2N/128, K/128] (unit stride along K); BLOCK_K = 128."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tok = (pair // TOPK).to(tl.int64)
    x_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows follow the I gate rows
    # scale pointers (read only under FP8): the rows' tokens; the gate and up rows' 128-row weight blocks
    xs_ptrs = XS + tok * stride_xsm
    gs_ptrs = WS + e * stride_wse + (offs_n // BLOCK_K) * stride_wsn
    us_ptrs = WS + e * stride_wse + ((offs_n + N) // BLOCK_K) * stride_wsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = offs_k < K - k0
        a = tl.load(x_ptrs + k0, mask=valid[:, None] & mk[None, :], other=0.0)
        g = tl.load(g_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        u = tl.load(u_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        kb = k0 // BLOCK_K
        acc_g = _k_step(
            acc_g, a, g, xs_ptrs + kb * stride_xsk, gs_ptrs + kb, valid, mask_n, FP8, DOT_PREC, DOT_F32
        )
        acc_u = _k_step(
            acc_u, a, u, xs_ptrs + kb * stride_xsk, us_ptrs + kb, valid, mask_n, FP8, DOT_PREC, DOT_F32
        )
    store_swiglu(acc_g, acc_u, limit, H, offs_m, offs_n, stride_hm, valid, mask_n, HAS_LIMIT)


@triton.jit
def _down_weighted(
    H, W, Y, Pairs, BlockExpert, NumRows, TopkW, HS, WS,
    num_pairs, N, K,
    stride_hm, stride_we, stride_wn, stride_ym, stride_hsm, stride_hsk, stride_wse, stride_wsn,
    FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """FP8: H is e4m3 with per-(row, 128-group) scales HS; W e4m3 with block scales WS [E, N/128,
    K/128] (unit stride along K); BLOCK_K = 128."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
    w_ptrs = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    hs_ptrs = HS + offs_m.to(tl.int64) * stride_hsm  # scale pointers, read only under FP8
    ws_ptrs = WS + e * stride_wse + (offs_n // BLOCK_K) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = offs_k < K - k0
        a = tl.load(h_ptrs + k0, mask=valid[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        kb = k0 // BLOCK_K
        acc = _k_step(
            acc, a, w, hs_ptrs + kb * stride_hsk, ws_ptrs + kb, valid, mask_n, FP8, DOT_PREC, DOT_F32
        )
    acc = acc * tl.load(TopkW + pair, mask=valid, other=0.0)[:, None]
    y_ptrs = Y + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def fused_moe(
    x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, w13_scale=None, w2_scale=None, config=None
):  # noqa: ANN001, ANN201
    """`FusedMoe`. `config` (a `MoEConfig`, for the tuning benchmark) replaces `choose_config`'s."""
    num_tokens, hidden = x.shape
    fmt = expert_format(w13, w2, w13_scale, w2_scale)
    num_experts, two_i, w13_cols = fp4.stacked_shape(w13) if fmt == "fp4" else w13.shape
    inter, k = two_i // 2, topk_ids.shape[1]
    pack = 2 if fmt == "fp4" else 1  # elements per byte along K
    w2_shape = fp4.stacked_shape(w2) if fmt == "fp4" else tuple(w2.shape)
    shapes = w13_cols * pack == hidden and w2_shape == (num_experts, hidden, inter // pack)
    assert shapes, (x.shape, w13.shape, w2.shape)
    scales = None if fmt == "float" else (w13_scale, w2_scale)
    if fmt == "fp4":  # row-major or tiled: contiguous (the kernels' offsets assume it)
        assert x.stride(1) == 1 and all(t.is_contiguous() for t in (w13, w2, *scales))
    else:
        assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if fmt == "fp8":
        assert all(s.dtype == torch.float32 and s.stride(2) == 1 for s in scales)
        assert w13.dtype == w2.dtype == torch.float8_e4m3fn, (w13.dtype, w2.dtype)
    if num_tokens == 0:
        return x.new_zeros(0, hidden)
    cfg = config or choose_config(num_tokens * k, num_experts, x.device, x.dtype, fmt == "fp8", fmt == "fp4")
    # FP4 "mma": the mma kernels' blocks, or "scaled" where they do not apply
    if fmt == "fp4" and fp4_step(cfg, x) == "mma":
        cfg = tilelang_fp4.config(cfg, num_tokens * k, num_experts, x, w13, w2, scales, tile=config is None)
    assert fmt != "fp8" or cfg.block_k == GROUP, "FP8 experts take one 128-group per K step"
    lay = moe_layout_fast(topk_ids, num_experts, cfg.block_m)
    # The Triton interpreter (CPU) rounds float32 to bf16 toward zero: there H and Y are written in
    # float32 and rounded by torch, to the nearest as the GPU's stores do.
    store_dtype = x.dtype if x.is_cuda else torch.float32
    h = torch.empty(lay.max_blocks * cfg.block_m, inter, dtype=store_dtype, device=x.device)
    y = torch.empty(num_tokens * k, hidden, dtype=store_dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    launch = launch_fp4 if fmt == "fp4" else _launch
    launch(x, w13, w2, h, y, weights, lay, cfg, k, swiglu_limit, scales)
    y = y.to(x.dtype)
    # one expert per row (the expert-parallel path's calls): nothing to sum, so no copy
    return y if k == 1 else y.view(num_tokens, k, hidden).sum(1)


def _launch(
    x, w13, w2, h, y, weights, lay: MoELayout, cfg: MoEConfig, topk: int, limit: float | None, scales
):  # noqa: ANN001, ANN202
    """FP8 (`scales` = (w13_scale, w2_scale)): x and then h are quantized by `fp8_act_quant` (see the
    module docstring) and the kernels read them as e4m3 + scales; bf16: the scale arguments are unused."""
    inter, hidden = h.shape[1], y.shape[1]
    fp8 = scales is not None
    common = dict(DOT_PREC=dot_precision(x.dtype), DOT_F32=dot_f32(x), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip
    quant = FP8_ACT_QUANT.get(x.device) if fp8 else None
    a, a_s = quant(x) if fp8 else (x, x)
    w13_s, w2_s = scales if fp8 else (w13, w2)
    half = cfg.block_n // 2
    _gate_up_swiglu[(lay.max_blocks, triton.cdiv(inter, half))](
        a, w13, h, lay.sorted_pairs, lay.block_expert, lay.num_rows, a_s, w13_s,
        lay.num_pairs, inter, x.shape[1], 0.0 if limit is None else float(limit),
        a.stride(0), w13.stride(0), w13.stride(1), h.stride(0), a_s.stride(0), a_s.stride(-1),
        w13_s.stride(0), w13_s.stride(1),
        TOPK=topk, HAS_LIMIT=limit is not None, FP8=fp8,
        BLOCK_M=cfg.block_m, BLOCK_N=half, BLOCK_K=cfg.block_k, **common,
    )  # fmt: skip
    h = h.to(x.dtype)  # a no-op on the GPU (see `fused_moe`)
    h, h_s = quant(h) if fp8 else (h, h)  # every row of h, padding included: a fixed grid, no sync
    _down_weighted[(lay.max_blocks, triton.cdiv(hidden, cfg.block_n))](
        h, w2, y, lay.sorted_pairs, lay.block_expert, lay.num_rows, weights, h_s, w2_s,
        lay.num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), h_s.stride(0), h_s.stride(-1),
        w2_s.stride(0), w2_s.stride(1),
        FP8=fp8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **common,
    )  # fmt: skip

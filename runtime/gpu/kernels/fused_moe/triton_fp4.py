"""The `fused_moe` Triton kernels for FP4 experts (W4A16, DeepSeek-V4's routed experts): the same two
launches over the same layout as the bf16 ones (`triton.py`), reading half a byte per weight.

A K step of BLOCK_K elements reads BLOCK_K/2 bytes per weight row. Byte j of a row holds elements 2j
(low nibble) and 2j+1 (high nibble), so instead of interleaving the nibbles back in registers the step
splits the activations: the even columns of x meet the low nibbles and the odd columns the high ones,
two dots of BLOCK_K/2 into the same float32 accumulator. A code becomes its value by bit placement (the
sign and 3 magnitude bits put where an fp16 keeps its sign, its two low exponent bits and its top
mantissa bit make the value times 2^-14, subnormal 0.5 included), times its group's UE8M0 scale (the
exponent byte shifted into a float32's exponent field). Every e2m1 value times a power of two is exact
in bf16, so the dots see exactly the reference's dequantized weights: only the order of the float32
accumulation differs. The activations are never quantized (W4A16), so no quantizer launches either.

At decode the grid is a few programs per touched expert and the step is a stream of packed bytes; the
unpacking is a handful of integer ops per weight on the CUDA cores, which on an H100 bound the kernels
at about a quarter of the copy bandwidth (docs/PERF.md, V4-Flash as stored).

`MoEConfig.fp4_step` picks the form of each K step:
- "values" (the first form): each weight's value times its group's scale, then two dots.
- "groups": one pair of dots per scale group (16 bytes a weight row) whose float32 partial is
  multiplied by the group's scale per column, so a weight costs its bit placement and one conversion.
- "scaled": Triton's `tl.dot_scaled` (bf16 x e2m1 with e8m0 scales per 32, the OCP MX layout these
  weights are already in: codes packed along K low nibble first, scales [N, K/32]). On Hopper Triton
  upcasts the codes itself (a register lookup per pair of codes) and the dot is one bf16 dot over the
  whole K step; on CPU the interpreter runs it. bf16 activations only (a float32 x takes "values").
All three see the same weight values (the scales are powers of two); the accumulation order differs.
benchmarks/kernels/fused_moe_tune.py --models v4 sweeps them with the tiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import dot_precision
from runtime.gpu.kernels.fused_moe.layout import MoELayout
from runtime.gpu.kernels.fused_moe.triton_layout import block_tile, store_swiglu
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand
from runtime.gpu.quant.fp4 import GROUP  # elements per scale along K; a K step is whole groups


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32 values."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e2m1_2m14(code):
    """e2m1 codes (int32, 0..15) -> their values times 2^-14, as float16 (the bits placed, nothing else)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1x4_scaled(packed, scale):
    """Packed bytes (uint8) and their groups' scale bytes (int32, same shape) -> (values of the low
    nibbles, values of the high nibbles) as bf16, each times 2^(scale - 127). PTX over 4 bytes at a
    time: each pair of bytes spread to the two halves of a register (prmt), a nibble's sign and 3
    magnitude bits placed where a bf16 keeps its sign, two low exponent bits and top mantissa bit (the
    value times 2^-126, code 1 subnormal), then two bf16x2 multiplies, by 2^126 and by the scale
    (exact: powers of two). About 3 instructions a weight, against a dozen in `_e2m1`'s float32 path.
    Strictly elementwise (each element's own scale register), so any register layout may pack it."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u, v, sc, sd;
        .reg .b32 bias;
        mov.b32 bias, 0x7E807E80;
        prmt.b32 sc, $5, $6, 0x5410;
        shl.b32 sc, sc, 7;
        prmt.b32 sd, $7, $8, 0x5410;
        shl.b32 sd, sd, 7;
        prmt.b32 t, $4, 0, 0x4140;
        shl.b32 u, t, 12;
        shl.b32 v, t, 6;
        and.b32 u, u, 0x80008000;
        and.b32 v, v, 0x01C001C0;
        or.b32 $0, u, v;
        mul.rn.bf16x2 $0, $0, bias;
        mul.rn.bf16x2 $0, $0, sc;
        shl.b32 u, t, 8;
        shl.b32 v, t, 2;
        and.b32 u, u, 0x80008000;
        and.b32 v, v, 0x01C001C0;
        or.b32 $2, u, v;
        mul.rn.bf16x2 $2, $2, bias;
        mul.rn.bf16x2 $2, $2, sc;
        prmt.b32 t, $4, 0, 0x4342;
        shl.b32 u, t, 12;
        shl.b32 v, t, 6;
        and.b32 u, u, 0x80008000;
        and.b32 v, v, 0x01C001C0;
        or.b32 $1, u, v;
        mul.rn.bf16x2 $1, $1, bias;
        mul.rn.bf16x2 $1, $1, sd;
        shl.b32 u, t, 8;
        shl.b32 v, t, 2;
        and.b32 u, u, 0x80008000;
        and.b32 v, v, 0x01C001C0;
        or.b32 $3, u, v;
        mul.rn.bf16x2 $3, $3, bias;
        mul.rn.bf16x2 $3, $3, sd;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fp4_groups(
    acc, x_rows, x_valid, w_cols, s_cols, k0, K, mask_n,
    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """acc + x @ W for one K step as BLOCK_K // GROUP scale groups: per group the even and odd columns
    of x ([BLOCK_M, GROUP / 2] from the row pointers x_rows [BLOCK_M, 1]) meet the low and high nibbles
    of its bytes ([GROUP / 2, BLOCK_N] from the column pointers w_cols [1, BLOCK_N]) in two dots. ASM:
    the weights come scaled from `_e2m1x4_scaled`; else the float32 partial takes the group's scale per
    column (bytes at s_cols [BLOCK_N]) times 2^14."""
    offs_g = tl.arange(0, GROUP // 2)
    for g in tl.static_range(BLOCK_K // GROUP):
        kk = k0 + g * GROUP
        mj = offs_g < (K - kk) // 2
        xm = x_valid[:, None] & mj[None, :]
        x_even = tl.load(x_rows + kk + 2 * offs_g[None, :], mask=xm, other=0.0)
        x_odd = tl.load(x_rows + kk + 1 + 2 * offs_g[None, :], mask=xm, other=0.0)
        packed = tl.load(w_cols + kk // 2 + offs_g[:, None], mask=mj[:, None] & mask_n[None, :], other=0)
        s = tl.load(s_cols + kk // GROUP, mask=mask_n, other=127).to(tl.int32)
        if ASM:
            lo, hi = _e2m1x4_scaled(packed, tl.broadcast_to(s[None, :], packed.shape))
            acc = tl.dot(x_even, lo, acc)
            acc = tl.dot(x_odd, hi, acc)
        else:
            packed = packed.to(tl.int32)
            lo = _e2m1_2m14(packed & 15).to(x_even.dtype)
            hi = _e2m1_2m14((packed >> 4) & 15).to(x_even.dtype)
            part = tl.dot(dot_operand(x_even, DOT_F32), dot_operand(lo, DOT_F32), input_precision=DOT_PREC)
            part = tl.dot(
                dot_operand(x_odd, DOT_F32), dot_operand(hi, DOT_F32), part, input_precision=DOT_PREC
            )
            acc += part * ((s << 23).to(tl.float32, bitcast=True) * 16384.0)[None, :]
    return acc


@triton.jit
def _fp4_groups_t(
    acc_t, x_cols, x_valid, w_rows, s_rows, k0, K, mask_n, BLOCK_K: tl.constexpr, GROUP: tl.constexpr
):
    """ "asm_t": `_fp4_groups`' ASM form with the weights as the dots' left operand, acc_t + W @ x^T
    ([BLOCK_N, BLOCK_M]): x's columns from x_cols [1, BLOCK_M], the weight rows' bytes from w_rows
    [BLOCK_N, 1] and their scales from s_rows [BLOCK_N]. A left operand can stay in registers, so the
    unpacked weights need not go through shared memory to reach the tensor cores."""
    offs_g = tl.arange(0, GROUP // 2)
    for g in tl.static_range(BLOCK_K // GROUP):
        kk = k0 + g * GROUP
        mj = offs_g < (K - kk) // 2
        xm = mj[:, None] & x_valid[None, :]
        x_even = tl.load(x_cols + kk + 2 * offs_g[:, None], mask=xm, other=0.0)
        x_odd = tl.load(x_cols + kk + 1 + 2 * offs_g[:, None], mask=xm, other=0.0)
        packed = tl.load(w_rows + kk // 2 + offs_g[None, :], mask=mask_n[:, None] & mj[None, :], other=0)
        s = tl.load(s_rows + kk // GROUP, mask=mask_n, other=127).to(tl.int32)
        lo, hi = _e2m1x4_scaled(packed, tl.broadcast_to(s[:, None], packed.shape))
        acc_t = tl.dot(lo, x_even, acc_t)
        acc_t = tl.dot(hi, x_odd, acc_t)
    return acc_t


@triton.jit
def _fp4_step(acc, x_even, x_odd, w_ptrs, s_ptrs, mask, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + x @ W for one K step: packed bytes [BLOCK_K/2, BLOCK_N] at w_ptrs, their groups' scale
    bytes at s_ptrs (same shape: a byte's group, per column), x split into even and odd columns."""
    packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    scale = (tl.load(s_ptrs, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    lo = (_e2m1(packed & 15) * scale).to(x_even.dtype)
    hi = (_e2m1((packed >> 4) & 15) * scale).to(x_even.dtype)
    acc = tl.dot(dot_operand(x_even, DOT_F32), dot_operand(lo, DOT_F32), acc, input_precision=DOT_PREC)
    return tl.dot(dot_operand(x_odd, DOT_F32), dot_operand(hi, DOT_F32), acc, input_precision=DOT_PREC)


@triton.jit
def _fp4_scaled(acc, x, w_ptrs, s_ptrs, mask_x, mask_w, mask_s):
    """acc + x @ W for one K step by `tl.dot_scaled`: x [BLOCK_M, BLOCK_K] bf16, packed bytes
    [BLOCK_K/2, BLOCK_N] at w_ptrs, scale bytes [BLOCK_N, BLOCK_K/32] at s_ptrs."""
    a = tl.load(x, mask=mask_x, other=0.0)
    w = tl.load(w_ptrs, mask=mask_w, other=0)
    s = tl.load(s_ptrs, mask=mask_s, other=127)
    return tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc)


@triton.jit
def _gate_up_swiglu_fp4(
    X, W, WS, H, Pairs, BlockExpert, NumRows,
    num_pairs, N, K, limit,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """`triton._gate_up_swiglu` on packed W [E, 2N, K/2] with scale bytes WS [E, 2N, K/32]."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # bytes of a K step: elements 2j, 2j + 1
    tok = (pair // TOPK).to(tl.int64)
    x_ptrs = X + tok[:, None] * stride_xm + 2 * offs_j[None, :]
    rows = offs_n[None, :].to(tl.int64)
    g_ptrs = W + e * stride_we + rows * stride_wn + offs_j[:, None]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows follow the N gate rows
    gs_ptrs = WS + e * stride_wse + rows * stride_wsn + offs_j[:, None] // (GROUP // 2)
    us_ptrs = gs_ptrs + N * stride_wsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if STEP == "scaled":
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        xk_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        gsk_ptrs = WS + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_g[None, :]
        usk_ptrs = gsk_ptrs + N * stride_wsn
        for k0 in range(0, K, BLOCK_K):
            mx = valid[:, None] & (offs_k < K - k0)[None, :]
            mw = (offs_j < (K - k0) // 2)[:, None] & mask_n[None, :]
            ms = mask_n[:, None] & (offs_g < (K - k0) // GROUP)[None, :]
            wk, sk = k0 // 2, k0 // GROUP
            acc_g = _fp4_scaled(acc_g, xk_ptrs + k0, g_ptrs + wk, gsk_ptrs + sk, mx, mw, ms)
            acc_u = _fp4_scaled(acc_u, xk_ptrs + k0, u_ptrs + wk, usk_ptrs + sk, mx, mw, ms)
    elif STEP == "asm_t":
        x_cols = X + tok[None, :] * stride_xm
        g_rows = W + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        gs_rows = WS + e * stride_wse + offs_n.to(tl.int64) * stride_wsn
        acc_gt = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_ut = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_gt = _fp4_groups_t(acc_gt, x_cols, valid, g_rows, gs_rows, k0, K, mask_n, BLOCK_K, GROUP)
            acc_ut = _fp4_groups_t(
                acc_ut, x_cols, valid, g_rows + N * stride_wn, gs_rows + N * stride_wsn, k0, K, mask_n,
                BLOCK_K, GROUP,
            )  # fmt: skip
        acc_g, acc_u = tl.trans(acc_gt), tl.trans(acc_ut)
    elif STEP == "groups" or STEP == "asm":
        x_rows = X + tok[:, None] * stride_xm
        g_cols = W + e * stride_we + rows * stride_wn
        gs_cols = WS + e * stride_wse + offs_n.to(tl.int64) * stride_wsn
        for k0 in range(0, K, BLOCK_K):
            acc_g = _fp4_groups(
                acc_g,
                x_rows,
                valid,
                g_cols,
                gs_cols,
                k0,
                K,
                mask_n,
                BLOCK_K,
                GROUP,
                DOT_PREC,
                DOT_F32,
                STEP == "asm",
            )
            acc_u = _fp4_groups(
                acc_u, x_rows, valid, g_cols + N * stride_wn, gs_cols + N * stride_wsn, k0, K, mask_n,
                BLOCK_K, GROUP, DOT_PREC, DOT_F32, STEP == "asm",
            )  # fmt: skip
    else:
        for k0 in range(0, K, BLOCK_K):
            mj = offs_j < (K - k0) // 2
            x_even = tl.load(x_ptrs + k0, mask=valid[:, None] & mj[None, :], other=0.0)
            x_odd = tl.load(x_ptrs + k0 + 1, mask=valid[:, None] & mj[None, :], other=0.0)
            mask = mj[:, None] & mask_n[None, :]
            wk, sk = k0 // 2, k0 // GROUP
            acc_g = _fp4_step(acc_g, x_even, x_odd, g_ptrs + wk, gs_ptrs + sk, mask, DOT_PREC, DOT_F32)
            acc_u = _fp4_step(acc_u, x_even, x_odd, u_ptrs + wk, us_ptrs + sk, mask, DOT_PREC, DOT_F32)
    store_swiglu(acc_g, acc_u, limit, H, offs_m, offs_n, stride_hm, valid, mask_n, HAS_LIMIT)


@triton.jit
def _down_weighted_fp4(
    H, W, WS, Y, Pairs, BlockExpert, NumRows, TopkW,
    num_pairs, N, K,
    stride_hm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """`triton._down_weighted` on packed W [E, N, K/2] with scale bytes WS [E, N, K/32]."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)
    h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + 2 * offs_j[None, :]
    rows = offs_n[None, :].to(tl.int64)
    w_ptrs = W + e * stride_we + rows * stride_wn + offs_j[:, None]
    s_ptrs = WS + e * stride_wse + rows * stride_wsn + offs_j[:, None] // (GROUP // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if STEP == "scaled":
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        hk_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
        sk_ptrs = WS + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_g[None, :]
        for k0 in range(0, K, BLOCK_K):
            mh = valid[:, None] & (offs_k < K - k0)[None, :]
            mw = (offs_j < (K - k0) // 2)[:, None] & mask_n[None, :]
            ms = mask_n[:, None] & (offs_g < (K - k0) // GROUP)[None, :]
            acc = _fp4_scaled(acc, hk_ptrs + k0, w_ptrs + k0 // 2, sk_ptrs + k0 // GROUP, mh, mw, ms)
    elif STEP == "asm_t":
        h_cols = H + offs_m[None, :].to(tl.int64) * stride_hm
        w_rows = W + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_rows = WS + e * stride_wse + offs_n.to(tl.int64) * stride_wsn
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_t = _fp4_groups_t(acc_t, h_cols, valid, w_rows, s_rows, k0, K, mask_n, BLOCK_K, GROUP)
        acc = tl.trans(acc_t)
    elif STEP == "groups" or STEP == "asm":
        h_rows = H + offs_m[:, None].to(tl.int64) * stride_hm
        w_cols = W + e * stride_we + rows * stride_wn
        s_cols = WS + e * stride_wse + offs_n.to(tl.int64) * stride_wsn
        for k0 in range(0, K, BLOCK_K):
            acc = _fp4_groups(
                acc,
                h_rows,
                valid,
                w_cols,
                s_cols,
                k0,
                K,
                mask_n,
                BLOCK_K,
                GROUP,
                DOT_PREC,
                DOT_F32,
                STEP == "asm",
            )
    else:
        for k0 in range(0, K, BLOCK_K):
            mj = offs_j < (K - k0) // 2
            h_even = tl.load(h_ptrs + k0, mask=valid[:, None] & mj[None, :], other=0.0)
            h_odd = tl.load(h_ptrs + k0 + 1, mask=valid[:, None] & mj[None, :], other=0.0)
            mask = mj[:, None] & mask_n[None, :]
            acc = _fp4_step(
                acc, h_even, h_odd, w_ptrs + k0 // 2, s_ptrs + k0 // GROUP, mask, DOT_PREC, DOT_F32
            )
    acc = acc * tl.load(TopkW + pair, mask=valid, other=0.0)[:, None]
    y_ptrs = Y + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


FP4_STEPS = ("values", "groups", "scaled", "asm", "asm_t")
FP4_DEFAULT_STEP = "values"


def fp4_step(cfg, x) -> str:  # noqa: ANN001
    """The config's K-step form; "values" for a float32 x ("scaled" and "asm" make bf16 operands), and
    "groups" for "asm" on the CPU (the interpreter runs no PTX)."""
    assert cfg.fp4_step in FP4_STEPS, cfg.fp4_step
    if cfg.fp4_step in ("scaled", "asm", "asm_t") and x.dtype != torch.bfloat16:
        return "values"
    return "groups" if cfg.fp4_step in ("asm", "asm_t") and not x.is_cuda else cfg.fp4_step


def launch_fp4(x, w13, w2, h, y, weights, lay: MoELayout, cfg, topk: int, limit: float | None, scales):  # noqa: ANN001
    """The two FP4 launches (`triton._launch`'s arguments; `scales` = (w13_scale, w2_scale) bytes)."""
    assert cfg.block_k % GROUP == 0, "a K step is whole scale groups"
    (w13_s, w2_s), inter, hidden = scales, h.shape[1], y.shape[1]
    common = dict(GROUP=GROUP, DOT_PREC=dot_precision(x.dtype), DOT_F32=dot_f32(x), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, STEP=fp4_step(cfg, x))  # fmt: skip
    half = cfg.block_n // 2
    _gate_up_swiglu_fp4[(lay.max_blocks, triton.cdiv(inter, half))](
        x, w13, w13_s, h, lay.sorted_pairs, lay.block_expert, lay.num_rows,
        lay.num_pairs, inter, hidden, 0.0 if limit is None else float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), w13_s.stride(0), w13_s.stride(1), h.stride(0),
        TOPK=topk, HAS_LIMIT=limit is not None, BLOCK_M=cfg.block_m, BLOCK_N=half, BLOCK_K=cfg.block_k,
        **common,
    )  # fmt: skip
    h = h.to(x.dtype)  # a no-op on the GPU (the interpreter writes float32: see `triton.fused_moe`)
    _down_weighted_fp4[(lay.max_blocks, triton.cdiv(hidden, cfg.block_n))](
        h, w2, w2_s, y, lay.sorted_pairs, lay.block_expert, lay.num_rows, weights,
        lay.num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2_s.stride(0), w2_s.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **common,
    )  # fmt: skip

"""The `fused_moe` Triton kernels for FP4 experts (W4A16, DeepSeek-V4's routed experts): the same two
launches over the same layout as the bf16 ones (`triton.py`), reading half a byte per weight.

A K step of BLOCK_K elements reads BLOCK_K/2 bytes per weight row: byte j holds elements 2j (low nibble)
and 2j+1 (high nibble), with one UE8M0 scale byte per 32 elements. The experts come row-major or tiled
(`fp4.tile_experts`, the served model's form: 16-row x 128-k tiles); a constexpr picks the offsets
(`_row_offsets`, `_col_offsets`), the tiles' contents being the same rows' bytes. `MoEConfig.fp4_step` picks how a step
turns them into a dot:
- "scaled" (the default for bf16 activations): Triton's `tl.dot_scaled`, bf16 x e2m1 with e8m0 scales
  per 32. The weights are already in that OCP MX layout (codes packed along K low nibble first, scales
  [N, K/32]), so the tiles go in as loaded; on Hopper Triton upcasts the codes itself and runs one bf16
  dot over the whole K step, and on CPU the interpreter runs it.
- "mma" (the default): at decode and verify blocks (8-32 pairs) with bf16 activations, not Triton at
  all: `tilelang_fp4.py`'s mma.sync kernels, which turn the codes into mma operands in registers;
  elsewhere (prefill blocks, shapes it does not take) "scaled".
- "values" (float32 activations: the parity tests): the even columns of x meet the low nibbles and the
  odd columns the high ones, two dots of BLOCK_K/2 into one float32 accumulator. A code becomes its value
  by bit placement (sign and 3 magnitude bits put where an fp16 keeps its sign, two low exponent bits and
  top mantissa bit: the value times 2^-14, subnormal 0.5 included), times its group's scale (the exponent
  byte shifted into a float32's exponent field).
Every e2m1 value times a power of two is exact in bf16, so both forms compute with exactly the reference's
dequantized weights: only the order of the float32 accumulation differs. The activations are never
quantized (W4A16), so no quantizer launches either.

Timed on an H100 (docs/PERF.md, "DeepSeek-V4-Flash as stored"): at V4-Flash's experts "scaled" takes
64 tokens in 2.51 ms against 3.64 ms (1,104 GB/s, 37% of copy, at the 16 x 128 x 64 tile `choose_config`
gives FP4 decode batches) and 4,096 tokens in 8.2 against 30.1 ms. A form that unpacked the codes by PTX
(4 bytes per instruction sequence) with the weights as the dot's left operand measured between the two;
it, the same PTX as the right operand and per-group dots (both untimed) were dropped (git history), as
were `dot_scaled` with the weights as the left operand (slower at every size) and scale bytes loaded a
step ahead (no change). Nsight Compute puts both decode kernels at 70-78% of instruction issue and 34-37%
of DRAM bandwidth: the lowering's shared-memory round trips and per-weight instructions bound them, not
loads or tiles (PERF.md: what would close the gap)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import dot_precision
from runtime.gpu.kernels.fused_moe import tilelang_fp4
from runtime.gpu.kernels.fused_moe.layout import MoELayout
from runtime.gpu.kernels.fused_moe.triton_layout import block_tile, store_swiglu
from runtime.gpu.kernels.triton_utils import dot_f32, dot_operand
from runtime.gpu.quant import fp4
from runtime.gpu.quant.fp4 import GROUP  # elements per scale along K; a K step is whole groups

_TILE_ROWS = tl.constexpr(fp4.TILE_ROWS)  # rows of a tile of the tiled form
FP4_STEPS = ("values", "scaled", "mma")
FP4_DEFAULT_STEP = "mma"  # where `tilelang_fp4.supported` holds (decode and verify blocks); else "scaled"


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32 values."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _row_offsets(rows, stride_rows, COLS: tl.constexpr, TILED: tl.constexpr):
    """Offsets of rows (int64) in one expert's codes or scales: row-major (stride_rows: a row's), or
    tiled (`fp4.tile_experts`; stride_rows: a 16-row group's, COLS bytes a tile row)."""
    if TILED:
        return (rows // _TILE_ROWS) * stride_rows + (rows % _TILE_ROWS) * COLS
    return rows * stride_rows


@triton.jit
def _col_offsets(cols, COLS: tl.constexpr, TILED: tl.constexpr):
    """Offsets of byte columns within a row's share of its 16-row group: tiled, 16 x COLS bytes a tile."""
    if TILED:
        return (cols // COLS) * (_TILE_ROWS * COLS) + cols % COLS
    return cols


@triton.jit
def _fp4_step(acc, x_even, x_odd, w_ptrs, s_ptrs, mask, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """ "values": acc + x @ W for one K step: packed bytes [BLOCK_K/2, BLOCK_N] at w_ptrs, their groups'
    scale bytes at s_ptrs (same shape: a byte's group, per column), x split into even and odd columns."""
    packed = tl.load(w_ptrs, mask=mask, other=0).to(tl.int32)
    scale = (tl.load(s_ptrs, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    lo = (_e2m1(packed & 15) * scale).to(x_even.dtype)
    hi = (_e2m1((packed >> 4) & 15) * scale).to(x_even.dtype)
    acc = tl.dot(dot_operand(x_even, DOT_F32), dot_operand(lo, DOT_F32), acc, input_precision=DOT_PREC)
    return tl.dot(dot_operand(x_odd, DOT_F32), dot_operand(hi, DOT_F32), acc, input_precision=DOT_PREC)


@triton.jit
def _fp4_scaled(acc, a, w_ptrs, s_ptrs, mask_w, mask_s):
    """ "scaled": acc + a @ W for one K step by `tl.dot_scaled`: a [BLOCK_M, BLOCK_K] bf16 (loaded once
    for the gate and up halves), packed bytes [BLOCK_K/2, BLOCK_N] at w_ptrs, scale bytes
    [BLOCK_N, BLOCK_K/32] at s_ptrs."""
    w = tl.load(w_ptrs, mask=mask_w, other=0)
    s = tl.load(s_ptrs, mask=mask_s, other=127)
    return tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc)


@triton.jit
def _code_ptrs(w_rows, k0, offs_j, CODE_COLS: tl.constexpr, TILED: tl.constexpr):
    """[BLOCK_K/2, BLOCK_N] pointers to the code bytes of the K step at k0 (w_rows: the columns' rows)."""
    return w_rows[None, :] + _col_offsets(k0 // 2 + offs_j, CODE_COLS, TILED)[:, None]


@triton.jit
def _gate_up_swiglu_fp4(
    X, W, WS, H, Pairs, BlockExpert, NumRows,
    num_pairs, N, K, limit,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
    TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, SCALED: tl.constexpr,
    TILED: tl.constexpr, CODE_COLS: tl.constexpr, SCALE_COLS: tl.constexpr,
):  # fmt: skip
    """`triton._gate_up_swiglu` on packed W [E, 2N, K/2] with scale bytes WS [E, 2N, K/32], row-major or
    tiled (stride_wn, stride_wsn: a row's or a 16-row group's)."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # bytes of a K step: elements 2j, 2j + 1
    tok = (pair // TOPK).to(tl.int64)
    rows = offs_n.to(tl.int64)
    g_rows = W + e * stride_we + _row_offsets(rows, stride_wn, CODE_COLS, TILED)
    u_rows = W + e * stride_we + _row_offsets(rows + N, stride_wn, CODE_COLS, TILED)  # up rows follow gate's
    gs_rows = WS + e * stride_wse + _row_offsets(rows, stride_wsn, SCALE_COLS, TILED)
    us_rows = WS + e * stride_wse + _row_offsets(rows + N, stride_wsn, SCALE_COLS, TILED)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SCALED:
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        x_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs + k0, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            mw = (offs_j < (K - k0) // 2)[:, None] & mask_n[None, :]
            ms = mask_n[:, None] & (offs_g < (K - k0) // GROUP)[None, :]
            sg = _col_offsets(k0 // GROUP + offs_g, SCALE_COLS, TILED)[None, :]
            acc_g = _fp4_scaled(acc_g, a, _code_ptrs(g_rows, k0, offs_j, CODE_COLS, TILED), gs_rows[:, None] + sg,
                                mw, ms)  # fmt: skip
            acc_u = _fp4_scaled(acc_u, a, _code_ptrs(u_rows, k0, offs_j, CODE_COLS, TILED), us_rows[:, None] + sg,
                                mw, ms)  # fmt: skip
    else:
        x_ptrs = X + tok[:, None] * stride_xm + 2 * offs_j[None, :]
        for k0 in range(0, K, BLOCK_K):
            mj = offs_j < (K - k0) // 2
            x_even = tl.load(x_ptrs + k0, mask=valid[:, None] & mj[None, :], other=0.0)
            x_odd = tl.load(x_ptrs + k0 + 1, mask=valid[:, None] & mj[None, :], other=0.0)
            mask = mj[:, None] & mask_n[None, :]
            sg = _col_offsets((k0 + 2 * offs_j) // GROUP, SCALE_COLS, TILED)[:, None]  # each byte's group
            acc_g = _fp4_step(acc_g, x_even, x_odd, _code_ptrs(g_rows, k0, offs_j, CODE_COLS, TILED),
                              gs_rows[None, :] + sg, mask, DOT_PREC, DOT_F32)  # fmt: skip
            acc_u = _fp4_step(acc_u, x_even, x_odd, _code_ptrs(u_rows, k0, offs_j, CODE_COLS, TILED),
                              us_rows[None, :] + sg, mask, DOT_PREC, DOT_F32)  # fmt: skip
    store_swiglu(acc_g, acc_u, limit, H, offs_m, offs_n, stride_hm, valid, mask_n, HAS_LIMIT)


@triton.jit
def _down_weighted_fp4(
    H, W, WS, Y, Pairs, BlockExpert, NumRows, TopkW,
    num_pairs, N, K,
    stride_hm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, SCALED: tl.constexpr,
    TILED: tl.constexpr, CODE_COLS: tl.constexpr, SCALE_COLS: tl.constexpr,
):  # fmt: skip
    """`triton._down_weighted` on packed W [E, N, K/2] with scale bytes WS [E, N, K/32], row-major or
    tiled."""
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(NumRows):
        return
    e, offs_m, pair, valid, offs_n, mask_n = block_tile(b, Pairs, BlockExpert, num_pairs, N, BLOCK_M, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)
    rows = offs_n.to(tl.int64)
    w_rows = W + e * stride_we + _row_offsets(rows, stride_wn, CODE_COLS, TILED)
    s_rows = WS + e * stride_wse + _row_offsets(rows, stride_wsn, SCALE_COLS, TILED)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SCALED:
        offs_k = tl.arange(0, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_k[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(h_ptrs + k0, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            mw = (offs_j < (K - k0) // 2)[:, None] & mask_n[None, :]
            ms = mask_n[:, None] & (offs_g < (K - k0) // GROUP)[None, :]
            s_ptrs = s_rows[:, None] + _col_offsets(k0 // GROUP + offs_g, SCALE_COLS, TILED)[None, :]
            acc = _fp4_scaled(acc, a, _code_ptrs(w_rows, k0, offs_j, CODE_COLS, TILED), s_ptrs, mw, ms)
    else:
        h_ptrs = H + offs_m[:, None].to(tl.int64) * stride_hm + 2 * offs_j[None, :]
        for k0 in range(0, K, BLOCK_K):
            mj = offs_j < (K - k0) // 2
            h_even = tl.load(h_ptrs + k0, mask=valid[:, None] & mj[None, :], other=0.0)
            h_odd = tl.load(h_ptrs + k0 + 1, mask=valid[:, None] & mj[None, :], other=0.0)
            mask = mj[:, None] & mask_n[None, :]
            s_ptrs = s_rows[None, :] + _col_offsets((k0 + 2 * offs_j) // GROUP, SCALE_COLS, TILED)[:, None]
            acc = _fp4_step(acc, h_even, h_odd, _code_ptrs(w_rows, k0, offs_j, CODE_COLS, TILED), s_ptrs,
                            mask, DOT_PREC, DOT_F32)  # fmt: skip
    acc = acc * tl.load(TopkW + pair, mask=valid, other=0.0)[:, None]
    y_ptrs = Y + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


def fp4_step(cfg, x) -> str:  # noqa: ANN001
    """The config's K-step form; "values" for activations other than bf16 (`tl.dot_scaled` and the mma
    kernels take bf16)."""
    assert cfg.fp4_step in FP4_STEPS, cfg.fp4_step
    return cfg.fp4_step if x.dtype == torch.bfloat16 else "values"


def launch_fp4(x, w13, w2, h, y, weights, lay: MoELayout, cfg, topk: int, limit: float | None, scales):  # noqa: ANN001
    """The two FP4 launches (`triton._launch`'s arguments; `scales` = (w13_scale, w2_scale) bytes)."""
    step = fp4_step(cfg, x)
    if step == "mma":  # `tilelang_fp4.config` kept it: the kernels apply
        return tilelang_fp4.launch(x, w13, w2, h, y, weights, lay, topk, limit, scales)
    assert cfg.block_m >= 16, "Triton's dots take 16 rows or more"
    assert cfg.block_k % GROUP == 0, "a K step is whole scale groups"
    (w13_s, w2_s), inter, hidden = scales, h.shape[1], y.shape[1]
    tiled = fp4.is_tiled(w13)
    common = dict(GROUP=GROUP, DOT_PREC=dot_precision(x.dtype), DOT_F32=dot_f32(x), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, SCALED=step == "scaled", TILED=tiled,
                  CODE_COLS=fp4.TILE_COLS["codes"], SCALE_COLS=fp4.TILE_COLS["scales"])  # fmt: skip
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

"""FP4 (e2m1) weights with per-32 power-of-two scales, as DeepSeek-V4-Flash stores its routed experts.

A logical [N, K] weight is stored as [N, K/2] bytes (int8 in safetensors, `float4_e2m1fn_x2` in
torch): two e2m1 codes per byte, element 2j in the low nibble and 2j+1 in the high one. Its scale
is [N, K/32], one UE8M0 value (a power of two, `float8_e8m0fnu`) per 32 consecutive elements along
K. The real weight is `value(code) * scale`.

Sources: the official `inference/model.py` `Linear` (FP4 branch) and `convert.py` (`FP4_TABLE`,
nibble order) as quoted by ports, and transformers' `Fp8Dequantize._unpack_fp4` (same table and
order). No released checkpoint was opened here; see docs/deepseek_v4.md for what that leaves open.

Kept on the GPU as stored (`--quantization`, `keep_fp8`, when the config says `expert_dtype: fp4`): the
packed codes as `PACKED` (uint8) and the scales as their UE8M0 exponent bytes (uint8, value 2^(b - 127)),
so `model.to(bfloat16)` leaves both alone and the kernels read one byte per scale."""

from __future__ import annotations

import torch

GROUP = 32  # elements per scale along K
# e2m1: sign bit, 2 exponent bits, 1 mantissa bit; code -> value
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
PACKED_DTYPES = (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.int8))
PACKED = torch.uint8  # kept weights' codes and scale exponents


def is_packed(t: torch.Tensor) -> bool:
    return t.dtype in PACKED_DTYPES


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: UE8M0 (`float8_e8m0fnu`, or raw exponent bytes as uint8: 2^(b - 127)) or
    plain floats."""
    if scale.dtype == torch.uint8:
        return (scale.float() - 127.0).exp2()
    return scale.float()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed codes -> float32 [..., K] e2m1 values (unscaled)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    b = packed.contiguous().view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).long()
    return table[codes].flatten(-2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed [..., N, K/2] with scales [..., N, K/32] -> float32 [..., N, K]."""
    values = unpack(packed)
    k = values.shape[-1]
    if scale.shape[:-1] != values.shape[:-1] or scale.shape[-1] * GROUP != k:
        raise ValueError(
            f"FP4 weight of logical shape {tuple(values.shape)} needs scales {(*values.shape[:-1], k // GROUP)}"
            f" (one per {GROUP} along K), got {tuple(scale.shape)}"
        )
    return (values.unflatten(-1, (-1, GROUP)) * scale_values(scale).unsqueeze(-1)).flatten(-2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (int8 [..., N, K/2], float8_e8m0fnu scales [..., N, K/32]): per group of 32,
    scale = 2^ceil(log2(amax / 6)) (as the official `fp4_act_quant`), codes rounded to the nearest
    e2m1 value. How tests build FP4 checkpoints; `dequantize` is its inverse up to the rounding."""
    w = weight.float().unflatten(-1, (-1, GROUP))
    amax = w.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    x = (w / scale).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2)
    table = torch.tensor(E2M1[:8], dtype=torch.float32, device=weight.device)
    mag = (x.abs().unsqueeze(-1) - table).abs().argmin(-1)  # nearest magnitude code 0..7
    codes = (mag | ((x < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def scale_bits(scale: torch.Tensor) -> torch.Tensor | None:
    """Scales as UE8M0 exponent bytes (uint8, 2^(b - 127)): `float8_e8m0fnu` and uint8 as they are,
    float scales when every one is a power of two in range; None otherwise (the weight is then
    dequantized and quantized again, `load_float`)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    exp = torch.log2(scale.float())
    if not bool(((exp == exp.round()) & (exp >= -127) & (exp <= 127)).all()):
        return None
    return (exp + 127).to(torch.uint8)


def load_float(weight: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """Quantize a float weight [..., N, K] (on the destination's device) into views of a kept packed
    weight [..., N, K/2] and its scale bytes [..., N, K/32] (one expert, a gate or up half of one)."""
    q, s = quantize(value.to(weight.device))
    if q.shape != weight.shape or s.shape != scale.shape:
        raise ValueError(f"float weight {tuple(value.shape)} does not fit FP4 {tuple(weight.shape)} (packed)")
    weight.copy_(q.view(PACKED))
    scale.copy_(s.view(torch.uint8))


# The tiled form of a stack of experts' codes or scales, which the mma kernels need and every `fused_moe`
# form reads (`RoutedExperts.tile_fp4` tiles a served model's FP4 experts once loaded,
# `prepare_for_serving`). A row-major [E, R, C] stack becomes
# [E, R/16, C/cols, 16, cols]: tiles of 16 rows (an mma m-tile) by `cols` bytes, row-major inside, each
# 16-row group's tiles in K order. With TILE_COLS (128 elements of K: 64 code bytes, 4 scale bytes), one
# warp's share of a 128-K mma step is one contiguous tile (1,024 code bytes, 64 scale bytes) and a whole
# 16-row group is one contiguous run: in row-major order a warp instruction reads 8 rows x 64 bytes,
# which streams about 2.5 TB/s on an H200 against 4.1-4.3 for 512 contiguous bytes
# (benchmarks.kernels.fp4_load_probe).
TILE_ROWS = 16
TILE_COLS = {"codes": 64, "scales": 4}
TILE_K = 2 * TILE_COLS["codes"]  # K elements a tile covers; tiling needs K % TILE_K == 0


def tileable(rows: int, k: int) -> bool:
    """Whether a [rows, k] logical FP4 weight has a tiled form."""
    return rows % TILE_ROWS == 0 and k % TILE_K == 0


def is_tiled(t: torch.Tensor) -> bool:
    """A tiled expert stack (5-D) rather than a row-major one (3-D)."""
    return t.dim() == 5


def stacked_shape(t: torch.Tensor) -> tuple[int, int, int]:
    """(experts, rows, bytes a row) of an expert stack in either form."""
    if is_tiled(t):
        e, groups, tiles, rows, cols = t.shape
        return e, groups * rows, tiles * cols
    e, rows, cols = t.shape
    return e, rows, cols


def tile_experts(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[E, R, C] row-major -> [E, R/16, C/cols, 16, cols], a new contiguous tensor."""
    e, r, c = t.shape
    return t.reshape(e, r // TILE_ROWS, TILE_ROWS, c // cols, cols).transpose(2, 3).contiguous()


def untile_experts(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `tile_experts`: [E, R/16, C/cols, 16, cols] -> [E, R, C] row-major."""
    e, groups, tiles, rows, cols = t.shape
    return t.transpose(2, 3).reshape(e, groups * rows, tiles * cols)


def row_major(t: torch.Tensor) -> torch.Tensor:
    """An expert stack row-major, whichever form it is in."""
    return untile_experts(t) if is_tiled(t) else t


def tile_experts_in_place(t: torch.Tensor, cols: int) -> torch.Tensor:
    """`tile_experts` within t's own storage, one expert at a time (a whole V4-Flash layer's codes are
    3 GiB; the copy here is one expert's), returned as the tiled view of that storage."""
    e, r, c = t.shape
    assert t.is_contiguous() and r % TILE_ROWS == 0 and c % cols == 0, (t.shape, cols)
    for j in range(e):
        t[j].copy_(tile_experts(t[j : j + 1], cols).view(r, c))
    return t.view(e, r // TILE_ROWS, c // cols, TILE_ROWS, cols)


def tile_layer(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A layer's FP4 experts (`fused_moe`'s w13, w2 and their scales, row-major) in the tiled form, as
    new tensors (tests and benchmarks; `RoutedExperts.tile_fp4` tiles in place)."""
    codes, scales = TILE_COLS["codes"], TILE_COLS["scales"]
    return (tile_experts(w13, codes), tile_experts(w2, codes), tile_experts(w13_scale, scales),
            tile_experts(w2_scale, scales))  # fmt: skip

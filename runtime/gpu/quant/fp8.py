"""FP8 e4m3 weights with block scales, as DeepSeek-V3/R1 checkpoints store them.

A quantized linear `X.weight` [N, K] (float8_e4m3fn) comes with `X.weight_scale_inv` [ceil(N/bn),
ceil(K/bk)] float32: the real weight is `weight * scale_inv` broadcast over each bn x bk block, with
the block size from config `quantization_config.weight_block_size` (128 x 128 in the real models).

`dequantize_stream` pairs each weight with its scale as checkpoint tensors stream by (in any order,
across shards) and yields the dequantized weight. Its `keep` hook is where an FP8 GEMM kernel plugs
in: names it accepts are yielded as (fp8 weight, scale) untouched for a module that consumes them
(`layers/fp8_linear.py`, the routed experts).

`--quantization` (`keep_fp8`) decides whether a model keeps its weights in FP8: "none" dequantizes as
before, "fp8" keeps (quantizing float weights at load), "auto" keeps a 128 x 128 FP8 checkpoint on CUDA."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"
BLOCK = (128, 128)  # the block the FP8 GEMM kernels (`fp8_block_gemm`, `fused_moe` w/ scales) take
QUANTIZATION_MODES = ("auto", "none", "fp8")


def block_size(config) -> tuple[int, int] | None:
    """The checkpoint's FP8 block size, or None when it is not FP8 block-quantized."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        raise NotImplementedError(f"quantization {q.get('quant_method')!r} is not supported (fp8 only)")
    bn, bk = q.get("weight_block_size") or (128, 128)
    return int(bn), int(bk)


def check_quantization(mode: str) -> None:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r} ({', '.join(QUANTIZATION_MODES)})")


def keep_fp8(mode: str, config, device: torch.device | str) -> bool:
    """Whether the model keeps FP8 block-scaled weights (`--quantization`): "none" never, "fp8" always
    (a float checkpoint or dummy weights are quantized at load), "auto" when the checkpoint is FP8 in
    128 x 128 blocks and the device is CUDA (on the CPU the FP8 GEMM is the slow float32 reference)."""
    check_quantization(mode)
    if mode == "auto":
        return torch.device(device).type == "cuda" and block_size(config) == BLOCK
    return mode == "fp8"


def _expand(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    s = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)
    return s[..., : shape[-2], : shape[-1]]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [..., N, K] x block scales [..., ceil(N/bn), ceil(K/bk)] (float32, or UE8M0 powers of two as
    `float8_e8m0fnu`) -> float32 [..., N, K]. Leading dims: stacked experts."""
    bn, bk = block
    grid = (*weight.shape[:-2], -(-weight.shape[-2] // bn), -(-weight.shape[-1] // bk))
    if tuple(scale_inv.shape) != grid:
        shape = tuple(weight.shape)
        raise ValueError(
            f"FP8 weight {shape} in {bn}x{bk} blocks needs scales {grid}, got {tuple(scale_inv.shape)}"
        )
    return weight.float() * _expand(scale_inv.float(), weight.shape, block)


def quantize(
    weight: torch.Tensor, block: tuple[int, int], ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (fp8 weight, scale_inv [..., ceil(N/bn), ceil(K/bk)]) with per-block absmax
    scaling (how tests build FP8 checkpoints, and how `--quantization fp8` quantizes float weights; the
    inverse of `dequantize` up to fp8 rounding). Leading dims: stacked experts. `ue8m0`: scales rounded
    up to powers of two and stored as `float8_e8m0fnu`, as DeepSeek-V4 checkpoints do (`scale_fmt: ue8m0`)."""
    bn, bk = block
    *lead, n, k = weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = weight.float().new_zeros(*lead, nb * bn, kb * bk)
    padded[..., :n, :k] = weight.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    if ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, nb * bn, kb * bk)
    return q[..., :n, :k].to(FP8).contiguous(), scale_inv.to(torch.float8_e8m0fnu) if ue8m0 else scale_inv


def dequantize_stream(
    tensors: Iterator[tuple[str, torch.Tensor]],
    block: tuple[int, int],
    keep: Callable[[str], bool] = lambda name: False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield checkpoint tensors with FP8 weights dequantized (float32) once their scale is seen.

    Unpaired FP8 weights or scales left at the end are an error. For names where `keep(name)` is true
    the fp8 weight and its `weight_scale_inv` pass through unchanged."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name.removesuffix(SCALE_SUFFIX)
            if keep(base):
                yield name, t
            elif base in weights:
                yield base, dequantize(weights.pop(base), t, block)
            else:
                scales[base] = t
        elif t.dtype == FP8 and not keep(name):
            if name in scales:
                yield name, dequantize(t, scales.pop(name), block)
            else:
                weights[name] = t
        else:
            yield name, t
    if weights or scales:
        raise ValueError(
            f"FP8 checkpoint: weights without a scale {sorted(weights)[:5]}, scales without a weight "
            f"{sorted(scales)[:5]}"
        )

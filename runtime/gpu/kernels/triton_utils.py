"""Triton helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot_operand(x, DOT_F32: tl.constexpr):
    """`x` as a tl.dot operand: upcast to float32 when DOT_F32. The Triton interpreter (CPU tensors)
    computes bf16 dots wrongly, so launchers set DOT_F32 for CPU tensors; on the GPU it is a no-op."""
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


def dot_f32(t: torch.Tensor) -> bool:
    return t.device.type != "cuda" and t.dtype != torch.float32

"""silu(gate) * up in Triton: elementwise, one program per (token, column block); rounds like the
reference (silu rounded to the dtype, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul(G, U, Out, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + t * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.silu_and_mul`; gate and up [T, I] with unit column stride (column
    slices of the merged gate|up output are fine)."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
    n_rows, n_cols = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if n_rows:
        _silu_and_mul[(n_rows, triton.cdiv(n_cols, BLOCK))](
            gate, up, out, n_cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out

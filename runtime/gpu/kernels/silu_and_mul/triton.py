"""silu(gate) * up in Triton: elementwise, one program per (token, column block); rounds like the
reference (silu rounded to the dtype, then the product). With `rms_x` each program first computes the
token's 1 / rms (the folded-norm form, see `SiluAndMul`): wider column blocks then, so a
token's row of rms_x is read by fewer programs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.rms_norm.triton import inv_rms_of_row

BLOCK = 1024
BLOCK_RMS = 2048  # column block with rms_x
RMS_CHUNK = 1024


@triton.jit
def _silu_and_mul(
    G, U, Out, X, n_cols, n_x, eps, limit, stride_g, stride_u, stride_o, stride_x,
    HAS_RMS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, RMS_CHUNK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(G + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + t * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RMS:
        inv = inv_rms_of_row(X, t, stride_x, n_x, eps, RMS_CHUNK)
        g = (g * inv).to(G.dtype.element_ty).to(tl.float32)
        u = (u * inv).to(U.dtype.element_ty).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate, up, rms_x=None, rms_eps=0.0, limit=None):
    """`SiluAndMul`; gate and up with unit column stride (column slices of the merged gate|up output are
    fine)."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
    n_rows, n_cols = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    x = gate if rms_x is None else rms_x
    assert x.stride(-1) == 1 and x.shape[0] == n_rows
    block = BLOCK if rms_x is None else BLOCK_RMS
    if n_rows:
        _silu_and_mul[(n_rows, triton.cdiv(n_cols, block))](
            gate, up, out, x, n_cols, x.shape[-1], rms_eps, 0.0 if limit is None else float(limit),
            gate.stride(0), up.stride(0), out.stride(0), x.stride(0), HAS_RMS=rms_x is not None,
            HAS_LIMIT=limit is not None, BLOCK=block, RMS_CHUNK=RMS_CHUNK, num_warps=4,
        )  # fmt: skip
    return out

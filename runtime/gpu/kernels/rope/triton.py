"""Rotary embedding on q and k in one Triton launch (rotate-half layout, as Llama uses).

One program per token rotates all its q heads and k heads: the cos/sin row is read once. Out of
place, like the reference; inputs may be strided views (the q/k slices of the fused qkv output).
`rope_store` also writes the rotated k and the plain v straight into the paged KV pools: at batch 1
the separate store was two index_put launches per layer, about 4% of a Llama-8B decode step. With
`write_kv` it writes them back over k and v too, for a prefill kernel that reads them there.
With `rms_x` it also applies the folded input norm (see `RopeStore`): the program computes
its token's 1 / rms and scales q, k and v by it first, which takes the norm kernel off the step.

`rope_interleaved` (DeepSeek-V4) rotates each head's trailing channels in place, cos and sin computed
from the position in the program: one launch where the PyTorch form took about fifteen (angles, cos,
sin, repeats, the pair swap, float32 products, and a copy of the whole head through `torch.cat`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2
from runtime.gpu.kernels.rms_norm.triton import inv_rms_of_row

RMS_CHUNK = 1024


@triton.jit
def _rotate_heads(X, Out, t, stride_xt, stride_xh, stride_ot, stride_oh, n_heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  scale=1.0):  # fmt: skip
    """Rotate the heads of token t; `scale` (the folded norm's 1 / rms) applies first, rounded to X's
    dtype like the reference (a no-op at 1.0)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < n_heads)[:, None] & (offs_d < HALF)[None, :]
    x_ptrs = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    x1 = (x1 * scale).to(X.dtype.element_ty).to(tl.float32)
    x2 = (x2 * scale).to(X.dtype.element_ty).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    o_ptrs = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    # Round to the input's dtype first, as the reference does, then to the output's (an fp8 KV pool).
    tl.store(o_ptrs, o1.to(X.dtype.element_ty).to(Out.dtype.element_ty), mask=mask)
    tl.store(o_ptrs + HALF, o2.to(X.dtype.element_ty).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _cos_sin(Cos, Sin, pos, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The two halves of the position's cos and sin rows (the table repeats them), in float32."""
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    c1 = tl.load(Cos + pos * stride_c + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + pos * stride_c + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + pos * stride_c + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _rope(
    Pos, Q, K, Cos, Sin, QOut, KOut, n_q_heads, n_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(Cos, Sin, pos, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(K, KOut, t, stride_kt, stride_kh, stride_kot, stride_koh, n_kv_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HKV, BLOCK_HALF)  # fmt: skip


def rope(positions, q, k, cos, sin):
    """`Rope`: one program per token."""
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape[2] == head_dim and q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if n_tokens:
        half = head_dim // 2
        _rope[(n_tokens,)](
            positions, q, k, cos, sin, q_out, k_out, n_q_heads, n_kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            HALF=half, BLOCK_HQ=next_pow2(n_q_heads), BLOCK_HKV=next_pow2(n_kv_heads),
            BLOCK_HALF=next_pow2(half), num_warps=4,
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _rope_store(
    Pos, Loc, Q, K, V, Cos, Sin, QOut, KPool, VPool, X, n_q_heads, n_kv_heads, n_x, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_ks, stride_kph, stride_vs, stride_vph, stride_c, stride_x,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_RMS: tl.constexpr, RMS_CHUNK: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    scale = 1.0
    if HAS_RMS:
        scale = inv_rms_of_row(X, t, stride_x, n_x, eps, RMS_CHUNK)
    c1, c2, s1, s2 = _cos_sin(Cos, Sin, pos, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(Q, QOut, t, stride_qt, stride_qh, stride_qot, stride_qoh, n_q_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF, scale)  # fmt: skip
    # The pool row of this token is "token" `slot` of a [slots, Hkv, D] tensor: same helper, t = slot.
    _rotate_heads(K + t * stride_kt, KPool, slot, 0, stride_kh, stride_ks, stride_kph, n_kv_heads,
                  c1, c2, s1, s2, HALF, BLOCK_HKV, BLOCK_HALF, scale)  # fmt: skip
    if WRITE_KV:  # and back over k itself (loaded again: nothing above wrote it)
        _rotate_heads(K + t * stride_kt, K + t * stride_kt, 0, 0, stride_kh, 0, stride_kh, n_kv_heads,
                      c1, c2, s1, s2, HALF, BLOCK_HKV, BLOCK_HALF, scale)  # fmt: skip
    offs_h = tl.arange(0, BLOCK_HKV)
    offs_full = tl.arange(0, 2 * BLOCK_HALF)
    vmask = (offs_h < n_kv_heads)[:, None] & (offs_full < 2 * HALF)[None, :]
    vals = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_full[None, :], mask=vmask)
    if HAS_RMS:
        vals = (vals.to(tl.float32) * scale).to(V.dtype.element_ty)
        if WRITE_KV:
            tl.store(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_full[None, :], vals, mask=vmask)
    vals = vals.to(VPool.dtype.element_ty)  # a no-op unless the pool is fp8
    tl.store(VPool + slot * stride_vs + offs_h[:, None] * stride_vph + offs_full[None, :], vals, mask=vmask)


def rope_store(positions, q, k, v, cos, sin, loc, k_pool, v_pool, rms_x=None, rms_eps=0.0, write_kv=False):
    """`RopeStore`: one program per token, the norm's 1 / rms computed in it."""
    n_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and k_pool.dtype == v_pool.dtype
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    x = q if rms_x is None else rms_x
    assert x.stride(-1) == 1
    if n_tokens:
        half = head_dim // 2
        _rope_store[(n_tokens,)](
            positions, loc, q, k, v, cos, sin, q_out, k_pool, v_pool, x, n_q_heads, n_kv_heads,
            x.shape[-1], rms_eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1),
            k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), cos.stride(0),
            x.stride(0), HALF=half, BLOCK_HQ=next_pow2(n_q_heads), BLOCK_HKV=next_pow2(n_kv_heads),
            BLOCK_HALF=next_pow2(half), HAS_RMS=rms_x is not None, RMS_CHUNK=RMS_CHUNK, WRITE_KV=write_kv,
            num_warps=4,
        )  # fmt: skip
    return q_out


@triton.jit
def rotate_pairs(x, pos, InvFreq, first, half, scaling, sign, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    """x [ROWS, 2 PAIRS] float32, a row's channels in interleaved pairs (2p, 2p + 1): pair p rotated by
    angle pos * inv_freq[p - first] (times `sign`), cos and sin times `scaling`, where 0 <= p - first <
    half; every other pair unchanged. The one rotation the interleaved-rope kernels share."""
    a, b = tl.split(tl.reshape(x, (ROWS, PAIRS, 2)))
    i = tl.arange(0, PAIRS) - first
    on = (i >= 0) & (i < half)
    angle = pos.to(tl.float32) * tl.load(InvFreq + i, mask=on, other=0.0)
    cos = tl.where(on, tl.cos(angle) * scaling, 1.0)
    sin = tl.where(on, tl.sin(angle) * scaling * sign, 0.0)
    out = tl.join(a * cos[None, :] - b * sin[None, :], b * cos[None, :] + a * sin[None, :])
    return tl.reshape(out, (ROWS, 2 * PAIRS))


@triton.jit
def _rope_interleaved(
    X, Pos, InvFreq, n_heads, half, stride_xt, stride_xh, offset, scaling, sign,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Program (t, head block): the pairs (2i, 2i + 1) of channels offset.. of BLOCK_H heads of token t.
    The channels load and store as one contiguous row a head and split into pairs in registers: loads
    with a stride of 2 elements ran at about 270 GB/s (H200, a 4K-token prefill)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, 2 * BLOCK_HALF)
    mask = (offs_h < n_heads)[:, None] & (offs_c < 2 * half)[None, :]
    ptrs = X + t * stride_xt + offs_h[:, None].to(tl.int64) * stride_xh + offset + offs_c[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    out = rotate_pairs(x, tl.load(Pos + t), InvFreq, 0, half, scaling, sign, BLOCK_H, BLOCK_HALF)
    tl.store(ptrs, out.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _unit_rms_rope_interleaved(
    X, Pos, InvFreq, n_heads, dim, half, stride_xt, stride_xh, eps, scaling, sign,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (t, head block): BLOCK_H whole heads of token t divided by their rms (rounded as
    `unit_rms`: 1 / rms to x's dtype, then the product), then the trailing `half` pairs rotated."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_D)
    mask = (offs_h < n_heads)[:, None] & (offs_c < dim)[None, :]
    ptrs = X + t * stride_xt + offs_h[:, None].to(tl.int64) * stride_xh + offs_c[None, :]
    dtype = X.dtype.element_ty
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    inv = (1.0 / tl.sqrt(tl.sum(x * x, 1) / dim + eps)).to(dtype).to(tl.float32)
    y = (x * inv[:, None]).to(dtype).to(tl.float32)
    # the roped pairs are the last `half` of the row's dim / 2
    out = rotate_pairs(
        y, tl.load(Pos + t), InvFreq, dim // 2 - half, half, scaling, sign, BLOCK_H, BLOCK_D // 2
    )
    tl.store(ptrs, out.to(dtype), mask=mask)


def rope_interleaved(x, positions, inv_freq, scaling, inverse=False, unit_rms_eps=None):
    """`RopeInterleaved`: one program per (token, block of up to 16 heads; with `unit_rms_eps`, as many
    whole heads as make 4,096 channels)."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    tokens, heads, dim = x3.shape
    half = inv_freq.numel()
    assert x3.stride(2) == 1 and 2 * half <= dim, (x.shape, x.stride(), half)
    assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() and positions.shape == (tokens,)
    sign = -1.0 if inverse else 1.0
    if tokens and unit_rms_eps is not None:
        assert dim % 2 == 0, dim  # the pairs of the whole row are the rope's pairs
        block_d = next_pow2(dim)
        block_h = min(next_pow2(heads), max(1, 4096 // block_d))
        _unit_rms_rope_interleaved[(tokens, triton.cdiv(heads, block_h))](
            x3, positions, inv_freq, heads, dim, half, x3.stride(0), x3.stride(1), float(unit_rms_eps),
            float(scaling), sign, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    elif tokens:
        block_h = min(16, next_pow2(heads))
        _rope_interleaved[(tokens, triton.cdiv(heads, block_h))](
            x3, positions, inv_freq, heads, half, x3.stride(0), x3.stride(1), dim - 2 * half,
            float(scaling), sign, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half), num_warps=4,
        )  # fmt: skip
    return x

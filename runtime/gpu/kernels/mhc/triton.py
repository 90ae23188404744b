"""mHC in Triton: `mhc_pre` in two launches, `mhc_post` in one.

`mhc_pre`: the projection mix = unit_rms(h.flatten) fn^T is a skinny GEMM ([T, nD] x [nD, (2+n)n]; 24
columns for n = 4). The row scale factors out, mix = rsqrt(mean(h^2) + eps) (h fn^T), so kernel 1 reads
h once for both: one program per (block of tokens, K split) accumulates h fn^T (`tl.dot`, float32 ieee,
as the reference's float32 F.linear) and sum(h^2) over its share of K, and writes float32 partials;
split-K lets a decode-sized batch read fn (1.5 MB at V4-Flash) with many SMs. Kernel 2, one program
per token: sums the partials, applies sigmoid / softmax / Sinkhorn to the n x n tile in registers,
writes post and comb, and x = sum_j pre_j h_j, rounded to h's dtype; with a norm weight it then
RMS-normalises x like `rms_norm` (sum of squares of the rounded x, x recomputed in a second pass over D
instead of held: h's row is in cache). Grid sizes come from shapes only (no host sync).

`mhc_post`: one program per (token, block of D) forms all n output streams; rounds like the reference,
which runs in h's dtype (post and comb rounded to it, post_k out and the comb matmul each rounded, then
their sum)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2, num_sms

MIN_SPLIT_K = 256  # split-K: no split shorter than this


@triton.jit
def _mix(
    H, Fn, Part, Sq, T, K, k_chunk, stride_t,
    W: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Part[s, t, :W] = h[t, ks] fn[:, ks]^T and Sq[s, t] = sum h[t, ks]^2 over split s's share ks of K."""
    pid_t, s = tl.program_id(0), tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, N_PAD)
    k_lo = s * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    acc = tl.zeros([BLOCK_T, N_PAD], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    h_rows = H + rows.to(tl.int64)[:, None] * stride_t
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(Fn + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & (cols[None, :] < W), other=0.0)
        sq += tl.sum(x * x, 1)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    out = (s * T + rows.to(tl.int64)) * N_PAD
    tl.store(Part + out[:, None] + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(Sq + s * T + rows, sq, mask=row_ok)


@triton.jit
def _apply(
    H, Part, Sq, Base, Scale, NormW, Post, Comb, X,
    T, D, splits, iters, hc_eps, norm_eps, rms_eps, stride_t, stride_n,
    N: tl.constexpr, NP: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    k = tl.arange(0, NP)
    ok1 = i < N
    ok2 = ok1[:, None] & (k[None, :] < N)
    ik = i[:, None] * N + k[None, :]
    # the split-K partials of this token's mixing logits and sum of squares
    pre_l = tl.zeros([NP], tl.float32)
    post_l = tl.zeros([NP], tl.float32)
    comb_l = tl.zeros([NP, NP], tl.float32)
    sq = 0.0
    for s in range(splits):
        p = Part + (s * T + t) * N_PAD
        pre_l += tl.load(p + i, mask=ok1, other=0.0)
        post_l += tl.load(p + N + i, mask=ok1, other=0.0)
        comb_l += tl.load(p + 2 * N + ik, mask=ok2, other=0.0)
        sq += tl.load(Sq + s * T + t)
    r = tl.rsqrt(sq / (N * D) + norm_eps)
    pre = tl.sigmoid(pre_l * r * tl.load(Scale) + tl.load(Base + i, mask=ok1, other=0.0)) + hc_eps
    pre = tl.where(ok1, pre, 0.0)
    post = 2.0 * tl.sigmoid(post_l * r * tl.load(Scale + 1) + tl.load(Base + N + i, mask=ok1, other=0.0))
    tl.store(Post + t * N + i, post, mask=ok1)
    # comb: softmax over k, + eps, then Sinkhorn (columns, then rows and columns iters - 1 times)
    z = comb_l * r * tl.load(Scale + 2) + tl.load(Base + 2 * N + ik, mask=ok2, other=0.0)
    z = tl.where(k[None, :] < N, z, float("-inf"))
    e = tl.exp(z - tl.max(z, 1)[:, None])
    c = tl.where(ok2, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)
    c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 1)[:, None] + hc_eps)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    tl.store(Comb + t * N * N + ik, c, mask=ok2)
    # x = sum_j pre_j h_j, rounded to h's dtype; [+ RMSNorm]
    h_row = H + t * stride_t + i[:, None] * stride_n
    sumsq = 0.0
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        hh = tl.load(h_row + offs[None, :], mask=ok1[:, None] & (offs[None, :] < D), other=0.0)
        x = tl.sum(pre[:, None] * hh.to(tl.float32), 0).to(H.dtype.element_ty)
        if HAS_NORM:
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, 0)
        else:
            tl.store(X + t * D + offs, x, mask=offs < D)
    if HAS_NORM:
        inv = tl.rsqrt(sumsq / D + rms_eps)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            hh = tl.load(h_row + offs[None, :], mask=ok1[:, None] & (offs[None, :] < D), other=0.0)
            x = tl.sum(pre[:, None] * hh.to(tl.float32), 0).to(H.dtype.element_ty).to(tl.float32)
            y = (x * inv).to(H.dtype.element_ty).to(tl.float32)
            w = tl.load(NormW + offs, mask=offs < D, other=0.0).to(tl.float32)
            tl.store(X + t * D + offs, (y * w).to(X.dtype.element_ty), mask=offs < D)


@triton.jit
def _post(
    H, Out, Post, Comb, New, D, stride_t, stride_n, stride_o,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs < D
    k = tl.arange(0, NP)
    k_ok = k < N
    dt = New.dtype.element_ty
    o = tl.load(Out + t * stride_o + offs, mask=d_ok, other=0.0).to(tl.float32)
    p = tl.load(Post + t * N + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)
    mixed = tl.zeros([NP, BLOCK_D], tl.float32)
    for j in tl.static_range(N):  # mixed[k] += comb[j, k] h_j
        c = tl.load(Comb + t * N * N + j * N + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)
        hj = tl.load(H + t * stride_t + j * stride_n + offs, mask=d_ok, other=0.0).to(tl.float32)
        mixed += c[:, None] * hj[None, :]
    spread = (p[:, None] * o[None, :]).to(dt).to(tl.float32)
    new = spread + mixed.to(dt).to(tl.float32)
    tl.store(New + t * N * D + k[:, None] * D + offs[None, :], new.to(dt), mask=k_ok[:, None] & d_ok[None, :])


def _split_k(tokens: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_K, splits, K per split): enough programs to fill the GPU twice, no split under
    MIN_SPLIT_K. Untuned guesses."""
    block_t, block_k = (16, 64) if tokens <= 512 else (32, 64)
    t_blocks = triton.cdiv(tokens, block_t)
    splits = max(1, min(triton.cdiv(2 * num_sms(device), t_blocks), triton.cdiv(k, MIN_SPLIT_K)))
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return block_t, block_k, triton.cdiv(k, chunk), chunk


def mhc_pre(h, fn, base, scale, n, iters, hc_eps, norm_eps, norm_weight=None, rms_eps=1e-6):
    """`MhcPre`."""
    tokens, n_h, d = h.shape
    width = (2 + n) * n
    assert n_h == n and fn.shape == (width, n * d) and base.shape == (width,) and scale.numel() == 3
    assert fn.dtype == base.dtype == scale.dtype == torch.float32
    if h.stride(2) != 1 or h.stride(1) != d:  # flatten(1) must be a view
        h = h.contiguous()
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    dev = h.device
    post = torch.empty(tokens, n, dtype=torch.float32, device=dev)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=dev)
    x_dtype = h.dtype if norm_weight is None else torch.promote_types(h.dtype, norm_weight.dtype)
    x = torch.empty(tokens, d, dtype=x_dtype, device=dev)
    if tokens == 0:
        return x, post, comb
    block_t, block_k, splits, chunk = _split_k(tokens, n * d, dev)
    n_pad = max(16, next_pow2(width))
    part = torch.empty(splits, tokens, n_pad, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, tokens, dtype=torch.float32, device=dev)
    _mix[(triton.cdiv(tokens, block_t), splits)](
        h, fn, part, sq, tokens, n * d, chunk, h.stride(0),
        W=width, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    np2 = next_pow2(n)
    block_d = min(next_pow2(d), max(16, 8192 // np2))
    w = norm_weight.contiguous() if norm_weight is not None else base
    _apply[(tokens,)](
        h, part, sq, base, scale, w, post, comb, x,
        tokens, d, splits, iters, hc_eps, norm_eps, rms_eps, h.stride(0), h.stride(1),
        N=n, NP=np2, N_PAD=n_pad, BLOCK_D=block_d, HAS_NORM=norm_weight is not None,
        num_warps=min(8, max(1, np2 * block_d // 1024)),
    )  # fmt: skip
    return x, post, comb


def mhc_post(h, out, post, comb):
    """`MhcPost`."""
    tokens, n, d = h.shape
    assert out.shape == (tokens, d) and post.shape == (tokens, n) and comb.shape == (tokens, n, n)
    if h.stride(2) != 1:
        h = h.contiguous()
    if out.stride(1) != 1:
        out = out.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    new = torch.empty(tokens, n, d, dtype=h.dtype, device=h.device)
    if tokens == 0:
        return new
    np2 = next_pow2(n)
    block_d = min(next_pow2(d), max(16, 4096 // np2))
    _post[(tokens, triton.cdiv(d, block_d))](
        h, out, post, comb, new, d, h.stride(0), h.stride(1), out.stride(0),
        N=n, NP=np2, BLOCK_D=block_d, num_warps=min(8, max(1, np2 * block_d // 1024)),
    )  # fmt: skip
    return new

"""Rotary embedding in plain PyTorch, as `runtime.gpu.layers.rotary` applies it (rotate-half layout), and
DeepSeek-V4's interleaved form."""

from __future__ import annotations

import torch

from runtime.gpu.kernels.rms_norm.reference import scale_by_inv_rms, unit_rms


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope(positions, q, k, cos, sin):
    """`Rope`."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rope_store(positions, q, k, v, cos, sin, loc, k_pool, v_pool, rms_x=None, rms_eps=0.0, write_kv=False):
    """`RopeStore`."""
    k_in, v_in = k, v
    if rms_x is not None:
        q, k, v = (scale_by_inv_rms(t, rms_x, rms_eps) for t in (q, k, v))
    q_out, k_out = rope(positions, q, k, cos, sin)
    k_pool[loc] = k_out.to(k_pool.dtype)  # the pool may be fp8 (--kv-cache-dtype)
    v_pool[loc] = v.to(v_pool.dtype)
    if write_kv:
        k_in.copy_(k_out)
        v_in.copy_(v)
    return q_out


def rope_interleaved(x, positions, inv_freq, scaling, inverse=False, unit_rms_eps=None):
    """`RopeInterleaved`."""
    if unit_rms_eps is not None:
        x.copy_(unit_rms(x, unit_rms_eps))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)
    cos = (freqs.cos() * scaling).repeat_interleave(2, -1)
    sin = (freqs.sin() * scaling).repeat_interleave(2, -1)
    if inverse:
        sin = -sin
    rope_dim = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rope.copy_(rope.float() * cos + rotated.float() * sin)
    return x

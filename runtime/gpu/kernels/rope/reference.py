"""Rotary embedding in plain PyTorch, as `runtime.gpu.layers.rotary` applies it (rotate-half layout)."""

from __future__ import annotations

import torch

from runtime.gpu.kernels.rms_norm.reference import scale_by_inv_rms


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]; cos, sin: float32 [max_pos, D] tables whose two
    halves repeat (RotaryEmbedding.cos / .sin). Returns new rotated (q, k)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    loc: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rms_x: torch.Tensor | None = None,
    rms_eps: float = 0.0,
    write_kv: bool = False,
) -> torch.Tensor:
    """`rope`, then the rotated k and the plain v written to the paged pools at slots `loc` [T]
    (k_pool, v_pool: [slots, Hkv, D]). Returns the rotated q; k is consumed by the cache.
    With `rms_x` [T, H]: q, k, v came from a projection with the input RMSNorm's gain folded in, and
    are first scaled per token by 1 / rms(rms_x[t]) (`scale_by_inv_rms`).
    `write_kv`: the rotated k and the (scaled) v also overwrite k and v, in their dtype, for a prefill
    kernel that attends the step's own keys (`prefill_attention`)."""
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

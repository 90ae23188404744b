"""Rotary position embedding (rotate-half / neox layout) on q and k in one pass; `rope_store` also
writes k and v into the paged KV pools (the fused form the Triton attention backend uses).
`rope_interleaved` is DeepSeek-V4's form: interleaved pairs on each head's trailing channels, in place."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class Rope(Protocol):
    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] (may be strided views, e.g. slices of a fused qkv output, with
        unit last stride), positions: [T]; cos, sin: float32 [max_pos, D] tables whose two halves repeat
        (`RotaryEmbedding.cos` / `.sin`). Returns new rotated (q, k) in their dtypes, out of place:
        x * cos + rotate_half(x) * sin in float32, rounded to x's dtype."""
        ...


class RopeStore(Protocol):
    def __call__(
        self,
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
        """`Rope`, then the rotated k and the plain v written to the paged pools at slots `loc` [T]
        (k_pool, v_pool: [slots, Hkv, D]; an fp8 pool, --kv-cache-dtype, gets them rounded to k's and v's
        dtype first). Returns the rotated q; k is consumed by the cache.
        With `rms_x` [T, H]: q, k, v came from a projection with the input RMSNorm's gain folded in, and
        are first scaled per token by 1 / rms(rms_x[t]) (`rms_norm.reference.scale_by_inv_rms`, eps
        `rms_eps`). `write_kv`: the rotated k and the (scaled) v also overwrite k and v, in their dtype,
        for a prefill kernel that attends the step's own keys (`prefill_attention`)."""
        ...


class RopeInterleaved(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        scaling: float,
        inverse: bool = False,
        unit_rms_eps: float | None = None,
    ) -> torch.Tensor:
        """In place: x [T, d] or [T, H, d] (unit last stride; any row and head strides) has the trailing
        r = 2 * len(inv_freq) channels of each head rotated in interleaved pairs (2i, 2i + 1) by angle
        positions[t] * inv_freq[i] (float32; `inverse`: its negative), cos and sin times `scaling`:
        (a, b) -> (a cos - b sin, b cos + a sin) in float32, rounded to x's dtype. The first d - r
        channels are left as they are. With `unit_rms_eps`, each head is first divided by its rms over
        all d channels (`rms_norm.reference.unit_rms`, DeepSeek-V4's q norm), every channel rewritten.
        Returns x."""
        ...


ROPE = Op("rope", Rope)
ROPE.register("triton", "runtime.gpu.kernels.rope.triton:rope", triton_on_cuda)
ROPE.register("reference", "runtime.gpu.kernels.rope.reference:rope", always)
ROPE_STORE = Op("rope_store", RopeStore)
ROPE_STORE.register("triton", "runtime.gpu.kernels.rope.triton:rope_store", triton_on_cuda)
ROPE_STORE.register("reference", "runtime.gpu.kernels.rope.reference:rope_store", always)
ROPE_INTERLEAVED = Op("rope_interleaved", RopeInterleaved)
ROPE_INTERLEAVED.register("triton", "runtime.gpu.kernels.rope.triton:rope_interleaved", triton_on_cuda)
ROPE_INTERLEAVED.register("reference", "runtime.gpu.kernels.rope.reference:rope_interleaved", always)

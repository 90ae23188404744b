"""mHC (DeepSeek-V4 hyper-connections) around each sublayer: `mhc_pre` collapses the hc_mult residual
streams into the sublayer's input (optionally RMS-normed) and gives the post / comb mixings, `mhc_post`
spreads the sublayer's output back over the streams and mixes them. The math lives in `reference.py`;
`runtime.gpu.models.deepseek_v4.mhc` calls these ops."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class MhcPre(Protocol):
    def __call__(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        n: int,
        iters: int,
        hc_eps: float,
        norm_eps: float,
        norm_weight: torch.Tensor | None = None,
        rms_eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, D] (the n residual streams); fn [(2+n)n, nD], base [(2+n)n], scale [3] float32.
        -> (x [T, D] in h's dtype, post [T, n] float32, comb [T, n, n] float32). The (2+n)n mixing logits
        per token are unit_rms(h.flatten(1), norm_eps) fn^T, split into pre [n], post [n] and comb
        [n, n] (each scaled by its scale[i], plus its part of base): pre = sigmoid + hc_eps collapses
        the streams into x = sum_j pre_j h_j, post = 2 sigmoid, comb = softmax over the last axis +
        hc_eps, then normalised towards a doubly stochastic matrix: columns, then `iters` - 1 times rows
        and columns, each sum + hc_eps (`reference.mhc_pre`). Mixings in float32, the merge in h's dtype.
        With `norm_weight`, x is the sublayer's input norm of it, `rms_norm(x, norm_weight, rms_eps)`
        (the un-normed x is not needed; dtype promote(h, norm_weight))."""
        ...


class MhcPost(Protocol):
    def __call__(
        self, h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """h'_k = post_k out + sum_j comb[j, k] h_j in h's dtype (h [T, n, D], out [T, D], post [T, n] and
        comb [T, n, n] from `MhcPre`) -> [T, n, D]."""
        ...


MHC_PRE = Op("mhc_pre", MhcPre)
MHC_PRE.register("triton", "runtime.gpu.kernels.mhc.triton:mhc_pre", triton_on_cuda)
MHC_PRE.register("reference", "runtime.gpu.kernels.mhc.reference:mhc_pre", always)
MHC_POST = Op("mhc_post", MhcPost)
MHC_POST.register("triton", "runtime.gpu.kernels.mhc.triton:mhc_post", triton_on_cuda)
MHC_POST.register("reference", "runtime.gpu.kernels.mhc.reference:mhc_post", always)

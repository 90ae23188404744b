"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is `hc_mult` streams.

At each sublayer site the streams h [T, n, D] give, through one small projection of their RMS-normed
concatenation, three mixings: `pre` collapses the streams into the sublayer's input, `post` spreads its
output back over the streams, and `comb` (made doubly stochastic by Sinkhorn iterations) mixes the
streams into each other: h'_k = post_k f(x) + sum_j comb[j, k] h_j. The hyper-head collapses the streams
once more before the final norm. The math is the `mhc_pre` / `mhc_post` ops (kernels/mhc/: fused Triton
kernels on CUDA, the float32 PyTorch reference elsewhere); these modules hold the parameters."""

from __future__ import annotations

import torch
from torch import nn

from runtime.gpu.kernels.mhc import MHC_POST, MHC_PRE
from runtime.gpu.kernels.mhc.reference import mhc_head


class _Float32(nn.Module):
    def _apply(self, fn, recurse=True):  # `.to(bfloat16)` on the model keeps these in float32
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)


class HyperConnection(_Float32):
    """One mHC site (`attn_hc` / `ffn_hc`): fn [(2+n)n, nD], base [(2+n)n], scale [3]."""

    def __init__(
        self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(
        self, h: torch.Tensor, norm: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, D] -> (sublayer input x [T, D], post [T, n], comb [T, n, n]). With `norm` (an RMSNorm:
        the sublayer's input norm), x comes out normed by it, in the same launch on CUDA."""
        w, eps = (None, 1e-6) if norm is None else (norm.weight, norm.eps)
        fn = MHC_PRE.get(h.device)
        return fn(h, self.fn, self.base, self.scale, self.n, self.iters, self.hc_eps, self.norm_eps, w, eps)

    @staticmethod
    def merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """h'_k = post_k out + sum_j comb[j, k] h_j  (h [T, n, D], out [T, D])."""
        return MHC_POST.get(h.device)(h, out, post, comb)


class HyperHead(_Float32):
    """Final collapse of the streams: sum_j (sigmoid(x̂ hc_fn^T * hc_scale + hc_base)_j + eps) h_j."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return mhc_head(h, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)

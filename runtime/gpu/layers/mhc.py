"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is `hc_mult` streams.

At each sublayer site the streams h [T, n, D] give, through one small projection of their RMS-normed
concatenation, three mixings: `pre` collapses the streams into the sublayer's input, `post` spreads its
output back over the streams, and `comb` (made doubly stochastic by Sinkhorn iterations) mixes the
streams into each other: h'_k = post_k f(x) + sum_j comb[j, k] h_j. The hyper-head collapses the streams
once more before the final norm. Computed in float32 whatever the model dtype, like the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


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

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, D] -> (sublayer input x [T, D], post [T, n], comb [T, n, n])."""
        n = self.n
        mix = F.linear(_unit_rms(h.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        x = (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
        return x, post, comb

    @staticmethod
    def merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """h'_k = post_k out + sum_j comb[j, k] h_j  (h [T, n, D], out [T, D])."""
        dt = h.dtype
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


class HyperHead(_Float32):
    """Final collapse of the streams: sum_j (sigmoid(x̂ hc_fn^T * hc_scale + hc_base)_j + eps) h_j."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = F.linear(_unit_rms(h.flatten(1).float(), self.norm_eps), self.hc_fn)
        pre = torch.sigmoid(mix * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)

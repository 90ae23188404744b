"""mHC (manifold-constrained hyper-connections, DeepSeek-V4) in plain PyTorch: the truth for `mhc_pre` and
`mhc_post`, and the math `runtime.gpu.models.deepseek_v4.mhc` runs on the CPU.

The residual is n streams h [T, n, D]. One projection of their RMS-normed concatenation gives
(2 + n) n mixing logits per token: `pre` (sigmoid + eps) collapses the streams into the sublayer's input
x = sum_j pre_j h_j, `post` (2 sigmoid) spreads the sublayer's output back, and `comb` (softmax + eps,
then Sinkhorn iterations towards a doubly stochastic matrix) mixes the streams:
h'_k = post_k out + sum_j comb[j, k] h_j. Mixings in float32 whatever h's dtype; the merge in h's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.gpu.kernels.rms_norm.reference import rms_norm, unit_rms


def mhc_pre(h, fn, base, scale, n, iters, hc_eps, norm_eps, norm_weight=None, rms_eps=1e-6):
    """`MhcPre`."""
    mix = F.linear(unit_rms(h.flatten(1).float(), norm_eps), fn)
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    x = (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, rms_eps)
    return x, post, comb


def mhc_post(h, out, post, comb):
    """`MhcPost`."""
    dt = h.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


def mhc_head(
    h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """The final collapse before the model's norm: sum_j (sigmoid(mix_j scale + base_j) + eps) h_j, with
    mix = unit_rms(h.flatten) fn^T (fn [n, nD], base [n], scale [1]) -> [T, D] in h's dtype."""
    mix = F.linear(unit_rms(h.flatten(1).float(), norm_eps), fn)
    pre = torch.sigmoid(mix * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)

"""Random mHC inputs for the kernel tests and the benchmark: mixing logits of order one (fn scaled by
(nD)^-1/2, as trained weights give), so sigmoid, softmax and Sinkhorn all see varied values."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MHCCase:
    h: torch.Tensor  # [T, n, D] streams
    fn: torch.Tensor  # [(2+n)n, nD] float32
    base: torch.Tensor  # [(2+n)n] float32
    scale: torch.Tensor  # [3] float32
    norm_weight: torch.Tensor  # [D], the following RMSNorm's weight (in h's dtype)
    out: torch.Tensor  # [T, D] a sublayer output, for mhc_post
    n: int
    iters: int

    def pre_args(self, norm: bool = False) -> tuple:
        """Positional arguments of `mhc_pre` (hc_eps 1e-6, norm_eps 1e-6; RMSNorm eps 1e-6 with `norm`)."""
        args = (self.h, self.fn, self.base, self.scale, self.n, self.iters, 1e-6, 1e-6)
        return (*args, self.norm_weight, 1e-6) if norm else args


def mhc_case(
    tokens: int,
    n: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    iters: int = 20,
    seed: int = 0,
) -> MHCCase:
    dev = torch.device(device)
    g = torch.Generator(dev).manual_seed(seed)
    width = (2 + n) * n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev)

    return MHCCase(
        h=randn(tokens, n, dim).to(dtype),
        fn=randn(width, n * dim) * (n * dim) ** -0.5,
        base=0.5 * randn(width),
        scale=0.5 + torch.rand(3, generator=g, device=dev),
        norm_weight=(1 + 0.1 * randn(dim)).to(dtype),
        out=randn(tokens, dim).to(dtype),
        n=n,
        iters=iters,
    )

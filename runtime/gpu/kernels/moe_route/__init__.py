"""DeepSeekMoE routing (op `moe_route`): scores, group-limited top-k with correction bias, weights. One
Triton program per token on CUDA instead of a dozen small torch ops per MoE layer."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class MoeRoute(Protocol):
    def __call__(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        top_k: int,
        num_groups: int = 1,
        topk_group: int = 1,
        scoring: str = "sigmoid",
        normalize: bool = True,
        scaling: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] float32 (unit last stride); bias [E] float32 or None; E a multiple of
        `num_groups`. -> (weights [T, top_k] float32, ids [T, top_k] int64). Scores from the logits by
        `scoring` ("sigmoid" V3, "softmax" V2, "sqrtsoftplus" V4); experts chosen by top-k of
        scores + bias, limited to the `topk_group` best of `num_groups` expert groups (a group's score:
        the sum of its top 2 with a bias, its max without); weights are the plain scores of the chosen
        experts, divided by their sum when `normalize` (and top_k > 1), times `scaling`. The order of
        the k chosen experts is unspecified."""
        ...


MOE_ROUTE = Op("moe_route", MoeRoute)
MOE_ROUTE.register("triton", "runtime.gpu.kernels.moe_route.triton:moe_route", triton_on_cuda)
MOE_ROUTE.register("reference", "runtime.gpu.kernels.moe_route.reference:moe_route", always)

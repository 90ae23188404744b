"""DeepSeekMoE routing in plain PyTorch (float32): the truth for `moe_route`.

Scores from the router logits (sigmoid for V3, softmax for V2, sqrt(softplus) for V4); experts chosen by
top-k of scores + correction bias, limited to the `topk_group` best of `num_groups` expert groups
(a group's score: the sum of its top 2 with a bias, its max without); weights are the plain scores of
the chosen experts, optionally normalised, times `scaling`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(-1)


def moe_route(
    logits, bias, top_k, num_groups=1, topk_group=1, scoring="sigmoid", normalize=True, scaling=1.0
):
    """`MoeRoute`."""
    scores = score(logits, scoring)
    choice = scores if bias is None else scores + bias
    if num_groups > 1:
        grouped = choice.view(-1, num_groups, choice.shape[-1] // num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if bias is not None else grouped.amax(-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids

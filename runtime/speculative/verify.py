"""Lossless acceptance of sampled blocks.

A row verifying k drafts was fed [t, d1 .. dk] and the target sampled s0 .. sk at those positions, each
with the request's own rule (greedy, or temperature / top-k / top-p / penalties and its seeded draw), the
block's earlier drafts counting as its outputs. d_j is accepted while s_{j-1} == d_j; the row emits the
accepted drafts and the sample after them: s0 .. s_a, a + 1 tokens. For greedy requests that is the exact
match rule. For sampled ones it is rejection sampling with a one-hot draft distribution: d_j survives with
probability p_j(d_j), and when it does not, the emitted s_{j-1} is the target's draw conditioned on not
being d_j, which is the residual distribution (p - q)+ for q = one-hot(d_j). So every emitted token
follows the target's distribution, token for token what non-speculative decoding draws with the same
noise (a seeded request gives the same text either way)."""

from __future__ import annotations

import torch


def accept(
    samples: torch.Tensor, block_start: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """samples [P]: every sampled position of the step, rows' blocks one after another; block_start [B]:
    each row's first position in `samples`; drafts [B, K] the tokens each row was fed after its first
    (draft_lens [B] of them valid). Returns the emitted tokens [B, K + 1] (the first `counts[i]` of row i
    valid), counts [B] (accepted drafts + 1), and each emitted token's index in `samples` [B, K + 1]."""
    width = drafts.shape[1] + 1
    cols = torch.arange(width, device=samples.device)
    in_block = cols[None, :] <= draft_lens[:, None]
    index = torch.where(in_block, block_start[:, None] + cols, 0)
    emitted = torch.where(in_block, samples[index], 0)
    match = (emitted[:, :-1] == drafts) & in_block[:, 1:]
    accepted = match.int().cumprod(dim=1).sum(dim=1)
    return emitted, accepted + 1, index

"""The fixed blocks in PyTorch: a pair's row in its destination's block is its rank among the pairs
going there, in pair order."""

from __future__ import annotations

import torch


def pack(x, weights, slots, per_rank, ep, cap):  # noqa: ANN001, ANN201
    t, k = slots.shape
    flat = slots.reshape(-1)
    dest, local = flat // per_rank, flat % per_rank
    token = torch.arange(t * k, device=x.device) // k
    # each pair's row in its destination's block: how many earlier pairs go to the same rank
    onehot = (dest[:, None] == torch.arange(ep, device=x.device)[None, :]).long()  # no range check: no sync
    pos = (onehot.cumsum(0) - 1).gather(1, dest[:, None]).squeeze(1)
    where = dest * cap + pos
    rows = x.new_zeros(ep * cap, x.shape[1])
    rows[where] = x[token]
    w = torch.zeros(ep * cap, dtype=torch.float32, device=x.device)
    w[where] = weights.reshape(-1).float()
    ids = torch.zeros(ep * cap, dtype=torch.int64, device=x.device)
    ids[where] = local
    return rows, w, ids, where.view(t, k)


def combine(rows, where):  # noqa: ANN001, ANN201
    return rows[where].float().sum(1).to(rows.dtype)

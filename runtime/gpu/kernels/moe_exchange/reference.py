"""The reference exchange over `all_to_all_single` (NCCL or gloo): normal mode with splits read on the
host, low latency with fixed blocks (runtime/gpu/layers/expert_parallel.py)."""

from __future__ import annotations

import torch

from runtime.gpu import distributed
from runtime.gpu.kernels.moe_blocks import MOE_BLOCK_COMBINE, MOE_BLOCK_PACK
from runtime.gpu.kernels.moe_exchange import Experts


def exchange(
    x: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    per_rank: int,
    experts: Experts,
    max_tokens: int,
    low_latency: bool,
) -> torch.Tensor:
    from runtime.gpu.layers.expert_parallel import exchange_rows

    if low_latency:
        return _fixed_blocks(x, weights, slots, per_rank, experts, max_tokens * slots.shape[1], exchange_rows)
    t, k = slots.shape
    flat = slots.reshape(-1)
    token = torch.arange(t * k, device=x.device) // k
    dest, local, w = flat // per_rank, flat % per_rank, weights.reshape(-1).float()
    size = distributed.ep().size
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=size)
    recv = exchange_rows(send, [1] * size, [1] * size)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    rows = exchange_rows(x[token[order]], recv_splits, send_splits)
    ids = exchange_rows(local[order], recv_splits, send_splits)
    wr = exchange_rows(w[order], recv_splits, send_splits)
    # each row through its expert, weighted there (as the fused op weights before it sums)
    y = experts(rows, wr[:, None], ids[:, None]) if rows.shape[0] else rows
    back = exchange_rows(y, send_splits, recv_splits)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token[order], back.float()).to(x.dtype)


def _fixed_blocks(x, weights, slots, per_rank, experts, cap, exchange_rows) -> torch.Tensor:  # noqa: ANN001
    """Blocks of `cap` rows (the step's most tokens on any rank, times k) per rank pair, the same on
    every rank, so no host reads (kernels/moe_blocks)."""
    ep = distributed.ep().size
    send, send_w, send_local, where = MOE_BLOCK_PACK.get(x.device)(x, weights, slots, per_rank, ep, cap)
    splits = [cap] * ep
    rows = exchange_rows(send, splits, splits)
    wr = exchange_rows(send_w, splits, splits)
    ids = exchange_rows(send_local, splits, splits)
    y = experts(rows, wr[:, None], ids[:, None])
    return MOE_BLOCK_COMBINE.get(x.device)(exchange_rows(y, splits, splits), where)

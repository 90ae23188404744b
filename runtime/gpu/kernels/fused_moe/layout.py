"""The expert-sorted, block-padded layout the fused MoE kernels read, built on the device (no host sync).

The T*k (token, expert) pairs (pair p = t*k + j) are sorted by expert; each expert's segment is padded to
a multiple of `block_m`, so every block of `block_m` rows belongs to one expert and a GEMM program
needs no per-row expert lookup. Padding rows hold the sentinel T*k. Sizes are upper bounds known from
T, k, E and block_m alone (at most `P // block_m + min(E, P)` blocks, since sum ceil(c_e / bm) <=
sum floor(c_e / bm) + #nonzero experts), so shapes are fixed per batch size, as CUDA graphs need;
`num_rows` (on the device) says how many rows are real, and programs past it exit."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoELayout:
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32: pair index, or num_pairs for padding
    block_expert: torch.Tensor  # [max_blocks] int32: the expert of each block (past num_rows: clamped)
    num_rows: torch.Tensor  # [1] int32: padded rows in use (a multiple of block_m)
    num_pairs: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    return num_pairs // block_m + min(num_experts, num_pairs)


def moe_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoELayout:
    """topk_ids [T, k] -> the layout. A dozen small torch ops, all on topk_ids' device."""
    flat = topk_ids.reshape(-1).long()
    pairs, dev = flat.numel(), flat.device
    n_blocks = max_blocks(pairs, num_experts, block_m)
    # Counts with scatter_add_, not bincount: bincount sizes its output from max() on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    seg_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair indices in expert order
    expert = flat.gather(0, order)
    rank = torch.arange(pairs, device=dev) - seg_start[expert]
    dest = pad_end[expert] - padded[expert] + rank
    sorted_pairs = torch.full((n_blocks * block_m,), pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    first_row = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, first_row, right=True).clamp_(max=num_experts - 1)
    return MoELayout(sorted_pairs, block_expert.to(torch.int32), pad_end[-1:].to(torch.int32), pairs, block_m)

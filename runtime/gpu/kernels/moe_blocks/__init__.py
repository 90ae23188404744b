"""The fixed blocks of the low-latency expert-parallel exchange (runtime/gpu/layers/expert_parallel.py):
`moe_block_pack` puts each (token, expert slot) pair's row, routing weight and local expert into its
destination rank's block of `cap` rows; after the exchange and the experts, `moe_block_combine` sums each
token's rows back. Blocks have the same shape on every rank whatever the routing (no host reads, so CUDA
graphs capture them). On CUDA each is one Triton kernel: a decode step's MoE layer pays two launches for
the exchange's bookkeeping, where the PyTorch reference issues about twenty small ops."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class PackBlocks(Protocol):
    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, per_rank: int, ep: int, cap: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D]; weights [T, k] routing weights; slots [T, k] int64 physical expert slots (rank
        s // per_rank, local expert s % per_rank); each rank takes at most `cap` pairs (T * k <= cap
        per destination). Returns (rows [ep * cap, D] in x's dtype, weights [ep * cap] float32, local
        experts [ep * cap] int64, where [T, k] int64): pair (t, j) at row where[t, j] of rank
        slots[t, j] // per_rank's block (rows r * cap ..). Each pair gets a row of its own; the order
        inside a block is the implementation's. Rows no pair took hold zeros, weight 0, expert 0."""
        ...


class CombineBlocks(Protocol):
    def __call__(self, rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """rows [ep * cap, D] (the experts' weighted outputs, back in the blocks `pack` made); where
        [T, k] from `pack`. Returns [T, D] in rows' dtype: sum_j rows[where[t, j]], summed in float32."""
        ...


MOE_BLOCK_PACK = Op("moe_block_pack", PackBlocks)
MOE_BLOCK_PACK.register("triton", "runtime.gpu.kernels.moe_blocks.triton:pack", triton_on_cuda)
MOE_BLOCK_PACK.register("reference", "runtime.gpu.kernels.moe_blocks.reference:pack", always)
MOE_BLOCK_COMBINE = Op("moe_block_combine", CombineBlocks)
MOE_BLOCK_COMBINE.register("triton", "runtime.gpu.kernels.moe_blocks.triton:combine", triton_on_cuda)
MOE_BLOCK_COMBINE.register("reference", "runtime.gpu.kernels.moe_blocks.reference:combine", always)

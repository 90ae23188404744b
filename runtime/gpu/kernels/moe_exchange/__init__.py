"""Expert parallelism's token exchange: each token's routed pairs to the ranks holding their expert
slots, through those ranks' local experts, and back summed (runtime/gpu/layers/expert_parallel.py
says when and why). Implementations: DeepEP's `Buffer` (normal and low-latency kernels) on CUDA when
`deep_ep` imports; the reference: `all_to_all_single` over the EP group (NCCL or gloo), always."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, has_module

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MoeExchange(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slots: torch.Tensor,
        per_rank: int,
        experts: Experts,
        max_tokens: int,
        low_latency: bool,
    ) -> torch.Tensor:
        """x [T, D]; weights [T, k] float32 routing weights; slots [T, k] int64 physical expert slots
        (rank s // per_rank, local expert s % per_rank). `experts(rows, w [n, 1], local ids [n, 1])`
        runs rows through this rank's experts, each weighted. `max_tokens`: the step's most tokens on any
        rank (low latency sizes its blocks by it). Returns [T, D] in x's dtype: sum over k of
        weights * expert_slot(x), whatever rank holds the slot. Every EP rank calls it, T may be 0."""
        ...


def deep_ep_on_cuda(device: torch.device) -> bool:
    """deep_ep importable on CUDA, or a stand-in Buffer installed (`deep_ep.use_buffer_class`: tests)."""
    from runtime.gpu.kernels.moe_exchange import deep_ep as adapter

    return adapter.stand_in() or (device.type == "cuda" and has_module("deep_ep"))


MOE_EXCHANGE = Op("moe_exchange", MoeExchange)
MOE_EXCHANGE.register("deep_ep", "runtime.gpu.kernels.moe_exchange.deep_ep:exchange", deep_ep_on_cuda)
MOE_EXCHANGE.register("reference", "runtime.gpu.kernels.moe_exchange.reference:exchange", always)

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.gpu.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Stores a step's new K/V in the paged cache and attends each row's queries over its KV slots.

    `prepare` runs once per step (index tensors, masks); `forward` once per layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata into `batch.attn_meta`."""

    # True when `prepare_decode_graph` is implemented: all-decode steps can then run as CUDA graphs.
    supports_cuda_graph: bool = False

    def prepare_decode_graph(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int) -> None:
        """Metadata for an all-decode step from device tensors alone (no host reads, shapes fixed by the
        batch size and `max_seq_len`), so the step can be captured in a CUDA graph and replayed.

        `batch.rows` [B] and `seq_lens` [B] (prefix + 1) live in static buffers that change between
        replays; padding rows use row 0 with length 1 (slot 0, never attended by real rows)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.rms_norm.reference import scale_by_inv_rms
from runtime.gpu.kernels.rope import ROPE_STORE


class Rope(NamedTuple):
    """Rotary embedding still to apply to a step's q and k: positions [T], float32 cos/sin tables.

    `rms_x` [T, H]: q, k and v are projections of un-normalised `rms_x` whose input RMSNorm gain is
    folded into the weight (Llama `fold_norms`): each token's q, k, v are scaled by 1 / rms(rms_x[t])
    first, in the same kernel (`scale_by_inv_rms`)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rms_x: torch.Tensor | None = None
    rms_eps: float = 0.0

    def prescale(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v with the folded norm's scale applied (for backends without the fused kernel)."""
        if self.rms_x is None:
            return q, k, v
        return tuple(scale_by_inv_rms(t, self.rms_x, self.rms_eps) for t in (q, k, v))  # type: ignore[return-value]


class AttentionBackend(ABC):
    """Stores a step's new KV in the pool and attends each row's queries over its KV slots.

    Duties every backend has: `prepare` runs once per step (index tensors, masks, into
    `batch.attn_meta`); `prepare_decode_graph` does the same from device tensors alone for CUDA graphs.
    The per-layer entry point depends on the family's layout (`MHABackend.forward` here; MLA and
    DeepSeek-V4 backends declare theirs in their model packages)."""

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
    # True when `prepare_decode_graph` takes q_len > 1: verify steps (speculative decoding) then run as
    # CUDA graphs too.
    supports_verify_graph: bool = False
    # The KV pool's page size (`make_attention_backend`): position p of a row lives at offset
    # p % page_size of its (p // page_size)-th page, so kernels may read whole pages through a page table.
    page_size: int = 1
    # True when the backend's kernels compile a variant per launch shape (Triton): the runner then runs
    # throwaway mixed and prefill steps at start-up, so the first requests do not pay for the compiles.
    wants_warm_up: bool = False

    def prepare_decode_graph(
        self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int, q_len: int = 1
    ) -> None:
        """Metadata for an all-decode step from device tensors alone (no host reads, shapes fixed by the
        batch size and `max_seq_len`), so the step can be captured in a CUDA graph and replayed.

        `batch.rows` [B] and `seq_lens` [B] (prefix + q_len) live in static buffers that change between
        replays; padding rows use row 0 with length q_len (slot 0, never attended by real rows).
        `q_len` > 1 (`supports_verify_graph`): every row has q_len new tokens, consecutive in the batch,
        the last q_len positions of its length, each attending causally."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def graph_contexts(self, max_model_len: int) -> list[int]:
        """The `max_seq_len` values decode graphs are captured for, ascending; a step replays the graph of
        the smallest one that holds its longest row. One (max_model_len) where a graph's work does not
        grow with `max_seq_len` (the kernels read each row's own length on the device)."""
        return [max_model_len]


class MHABackend(AttentionBackend):
    """Multi-head (grouped-query) attention over an `MHAKVPool`: the Llama family's backends."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]. With `rope`, q and k
        are not rotated yet: the backend rotates them as it stores k (`rope_and_store`)."""

    @staticmethod
    def rope_and_store(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope | None,
        write_kv: bool = False,
    ) -> torch.Tensor:
        """Store the new k (rotated when `rope` is given) and v in the layer's pools; returns q, rotated.
        For backends that read every key back from the pools (the rotated k is not returned). One fused
        kernel on CUDA (`rope_store` op): rotating and storing separately cost three extra
        launches per layer, which a batch-1 decode step feels. `write_kv`: k and v are also overwritten
        with what was stored (rotated, scaled, in their own dtype), for kernels that read them there."""
        cache = batch.kv_pool
        if rope is None:
            cache.store(layer, batch.out_loc, k, v)
            return q
        op = ROPE_STORE.get(q.device)
        return op(
            rope.positions, q, k, v, rope.cos, rope.sin, batch.out_loc, cache.k[layer], cache.v[layer],
            rope.rms_x, rope.rms_eps, write_kv,
        )  # fmt: skip

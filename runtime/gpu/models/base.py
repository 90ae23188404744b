"""The model-family contract: what the runner may ask of a model, and nothing it has to discover.

A family (one package under `runtime/gpu/models/`) provides a `CausalLM` subclass: its layers, its KV
layout (`make_kv_pool`), the attention backends that read that layout (`make_attention_backend`), how
checkpoints map onto its parameters (`load_weights`), and its abilities (`ModelAbilities`), which the
worker reports to the scheduler in its capabilities message at start-up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from runtime.gpu import loader
from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kv_pool import KVPool, KVPoolSpec


@dataclass(frozen=True)
class ModelAbilities:
    # False when per-request state cannot start from a cached prefix: the engine then runs without the
    # radix cache
    prefix_cache: bool = True
    # --kv-cache-dtype fp8_e4m3: the family's pools and kernels read an e4m3 pool
    fp8_kv_cache: bool = False
    # --quantization fp8: the constructor takes `fp8_weights=True` and keeps FP8 block-scaled weights
    fp8_weights: bool = False
    # the pool can drop a request's last tokens (`KVPool.truncate`): speculative decoding's rejected drafts
    truncate_kv: bool = True


class CausalLM(nn.Module, ABC):
    """A decoder-only model over a step's flattened tokens (`ForwardBatch`)."""

    abilities: ClassVar[ModelAbilities] = ModelAbilities()
    config: object  # the transformers config it was built from

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        """Final hidden states of every token of the step, [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of the hidden states of the sampled tokens, in `logits_dtype`."""

    @property
    def logits_dtype(self) -> torch.dtype:
        return torch.float32

    # ------------------------------------------------------------------ KV layout and attention

    @abstractmethod
    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of the paged KV per token slot in a pool of `dtype` (for sizing the pool)."""

    def kv_bytes_per_row(self, dtype: torch.dtype) -> int:
        """Bytes of per-request state outside the pages, for each request row (none by default)."""
        return 0

    @abstractmethod
    def make_kv_pool(self, spec: KVPoolSpec) -> KVPool:
        """The family's KV pool."""

    @abstractmethod
    def make_attention_backend(self, name: str, page_size: int) -> AttentionBackend:
        """The attention backend `name` ("torch": the PyTorch reference; "triton": the kernel ops) for the
        family's layout, over a pool with pages of `page_size` tokens."""

    # ------------------------------------------------------------------ weights

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config says so (again after moving devices)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors by Hugging Face name (families with other names or formats override)."""
        loader.load_weights(self, tensors)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether this rank never reads checkpoint tensor `name` (another expert-parallel rank's
        experts); the loader then skips it unread."""
        return False

    def idle_forward(self) -> None:
        """Take part in one step's collectives with no tokens: a data-parallel rank with nothing to run
        while others step (families with expert parallelism; nothing otherwise)."""

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights for `--load-format dummy` (families with index tables override)."""
        loader.init_dummy_weights(self, seed)

    def prepare_for_serving(self) -> None:
        """Once, after the weights are loaded: weight transforms the serving path wants (none here)."""

    # ------------------------------------------------------------------ multi-token prediction (MTP)
    # DeepSeek's nextn layers, for the MTP drafter (runtime/speculative/mtp.py); none by default.

    @property
    def mtp_layers(self) -> list[nn.Module]:
        """The model's MTP layers (empty: the model has none, and cannot draft with `mtp`)."""
        return []

    @property
    def mtp_hidden_tap(self) -> int | None:
        """The main layer whose output the MTP layers read (None: the final hidden state)."""
        return None

    def make_mtp_kv_pool(self, spec: KVPoolSpec) -> KVPool:
        """The MTP drafter's own pool, for the MTP layers' attention."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP layers")

    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """MTP layer k on the previous stage's hidden states and the next tokens: its normed hidden
        states (logits through `compute_logits`)."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP layers")

    def mtp_store_kv(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> None:
        """MTP layer k's own state (its KV) for these entries, which is all the drafter needs of the
        tokens the target computes (only the chain reads the layer's output). By default the whole layer
        (`mtp_forward`, output dropped); a model that can write the KV alone overrides it."""
        self.mtp_forward(k, next_ids, hidden, positions, batch, attn)

"""Attention through the kernel ops (Triton on CUDA): same contract as the PyTorch reference backend.

`prepare` packs the step's per-row columns into one host tensor and moves it with one copy; lengths
needed for grid sizes (longest new part, longest row) come from the host lists, so no step syncs.
An all-decode step (every row one new token) runs the split-KV decode kernel; any other step, mixed
ones included, runs the extend kernel over every row (a decode row is an extend row of one token).
The kernels come from the op registry, so `CONDUIT_KERNEL_DECODE_ATTENTION=reference` (or
`..._EXTEND_ATTENTION`) swaps one for its reference for comparisons."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.gpu.attention.base import AttentionBackend, Rope
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels import registry
from runtime.gpu.kernels.common import choose_num_splits


@dataclass
class _Meta:
    decode: bool  # every row has exactly one new token, so q rows are batch rows
    rows: torch.Tensor  # [B] req_to_token rows
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_starts: torch.Tensor  # [B] first token of each row in the flattened step
    seq_lens: torch.Tensor  # [B] prefix + extend
    max_extend: int
    num_splits: int


class TritonAttentionBackend(AttentionBackend):
    # The kernels; bound from the registry on the first step's device unless set beforehand (tests).
    decode_fn: Callable[..., torch.Tensor] | None = None
    extend_fn: Callable[..., torch.Tensor] | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        if self.decode_fn is None:
            self.decode_fn = registry.get("decode_attention", device)
        if self.extend_fn is None:
            self.extend_fn = registry.get("extend_attention", device)
        prefix, ext = batch.prefix_lens, batch.extend_lens
        starts, seq_lens, total = [], [], 0
        for p, e in zip(prefix, ext, strict=True):
            starts.append(total)
            seq_lens.append(p + e)
            total += e
        host = torch.tensor([batch.rows_list, prefix, ext, starts, seq_lens], dtype=torch.int64)
        rows, prefix_t, ext_t, starts_t, seq_t = host.to(device, non_blocking=True).unbind(0)
        decode = bool(ext) and all(e == 1 for e in ext)
        max_len = max(seq_lens, default=1)
        splits = choose_num_splits(len(ext), self.num_kv_heads, max_len, device) if decode else 1
        batch.attn_meta = _Meta(decode, rows, prefix_t, ext_t, starts_t, seq_t, max(ext, default=0), splits)

    supports_cuda_graph = True

    def prepare_decode_graph(self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int) -> None:
        """Split count fixed by the batch size and `max_seq_len`: the kernel reads lengths on the device."""
        device = batch.input_ids.device
        if self.decode_fn is None:
            self.decode_fn = registry.get("decode_attention", device)
        if self.extend_fn is None:
            self.extend_fn = registry.get("extend_attention", device)
        b = batch.rows.shape[0]
        splits = choose_num_splits(b, self.num_kv_heads, max_seq_len, device)
        batch.attn_meta = _Meta(True, batch.rows, seq_lens - 1, None, None, seq_lens, 1, splits)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        cache, meta = batch.kv_cache, batch.attn_meta
        q = self.rope_and_store(layer, q, k, v, batch, rope)
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        args: tuple[Any, ...] = (q, k_pool, v_pool, batch.req_to_token, meta.rows)
        if meta.decode:
            return self.decode_fn(*args, meta.seq_lens, self.scale, num_splits=meta.num_splits)
        return self.extend_fn(
            *args, meta.prefix_lens, meta.extend_lens, meta.q_starts, self.scale, max_extend=meta.max_extend
        )

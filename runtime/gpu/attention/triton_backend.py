"""Attention through the kernel ops (Triton on CUDA): same contract as the PyTorch reference backend.

`prepare` packs the step's per-row columns into one host tensor and moves it with one copy; lengths
needed for grid sizes (longest new part, longest row) come from the host lists, so no step syncs.
An all-decode step (every row one new token) runs the split-KV decode kernel. In a mixed step the
leading rows of one new token (the scheduler puts decodes first) run the decode kernel too, and the
rest the extend kernel, each writing its own tokens of one output: the extend kernel would give each
decode row one program per q head over a 64-query block (the kv head's KV read once per q head, 63 of
64 query rows idle). `CONDUIT_MIXED_DECODE_KERNEL=0` sends a mixed step's decode rows through the
extend kernel as before, for comparisons.
The kernels come from the op registry, so `CONDUIT_KERNEL_DECODE_ATTENTION=reference` (or
`..._EXTEND_ATTENTION`) swaps one for its reference for comparisons."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime import envs
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
    num_decode: int = 0  # mixed steps: the leading rows of one token, which run the decode kernel


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
        # decode rows: all of them, or in a mixed step its leading single-token rows
        if decode or not self.mixed_decode:
            n_dec = len(ext) if decode else 0
        else:
            n_dec = next((i for i, e in enumerate(ext) if e != 1), len(ext))
        max_len = max(seq_lens[:n_dec], default=1)
        splits = choose_num_splits(n_dec, self.num_kv_heads, max_len, device) if n_dec else 1
        batch.attn_meta = _Meta(
            decode, rows, prefix_t, ext_t, starts_t, seq_t, max(ext, default=0), splits, n_dec
        )  # fmt: skip

    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.mixed_decode = envs.mixed_decode_kernel()  # mixed steps' leading decode rows: decode kernel

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
        n = meta.num_decode
        if n == 0:
            return self.extend_fn(
                *args, meta.prefix_lens, meta.extend_lens, meta.q_starts, self.scale, max_extend=meta.max_extend
            )  # fmt: skip
        # the decode rows' tokens are q's first n; the extend rows index q through their q_starts
        out = torch.empty_like(q)
        self.decode_fn(
            q[:n], k_pool, v_pool, batch.req_to_token, meta.rows[:n], meta.seq_lens[:n], self.scale,
            num_splits=meta.num_splits, out=out[:n],
        )  # fmt: skip
        return self.extend_fn(
            q, k_pool, v_pool, batch.req_to_token, meta.rows[n:], meta.prefix_lens[n:], meta.extend_lens[n:],
            meta.q_starts[n:], self.scale, max_extend=meta.max_extend, out=out,
        )  # fmt: skip

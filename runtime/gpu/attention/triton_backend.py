"""Attention through the kernel ops (Triton on CUDA): same contract as the PyTorch reference backend.

`prepare` packs the step's per-row columns into one host tensor and moves it with one copy; lengths
needed for grid sizes (longest new part, longest row) come from the host lists, so no step syncs.
An all-decode step (every row one new token) runs the split-KV decode kernel. In a mixed step the
leading rows of one new token (the scheduler puts decodes first) run the decode kernel too, and the
other rows the prefill kernel, each writing its own tokens of one output. The prefill kernel reads the
rows' new keys from the step's own k/v (written back rotated as they are stored) and gathers only a
cached prefix from the pool; a prefill kernel would give each decode row one program per q head over a
64-query block (63 of 64 query rows idle). Head dims that are not a power of two take the extend kernel,
which gathers every key from the pool. The kernels come from the op registry, so `CONDUIT_KERNEL_DECODE_ATTENTION=reference` (or
`..._EXTEND_ATTENTION`, `..._PREFILL_ATTENTION`) swaps one for its reference for comparisons."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.gpu.attention.base import MHABackend, Rope
from runtime.gpu.forward_batch import ForwardBatch, columns_to_device
from runtime.gpu.kernels.common import choose_num_splits
from runtime.gpu.kernels.decode_attention import DECODE_ATTENTION
from runtime.gpu.kernels.extend_attention import EXTEND_ATTENTION, PREFILL_ATTENTION


@dataclass
class _Meta:
    decode: bool  # every row has exactly one new token, so q rows are batch rows
    rows: torch.Tensor  # [B] req_to_token rows
    seq_lens: torch.Tensor  # [B] prefix + extend
    num_splits: int
    num_decode: int = 0  # mixed steps: the leading rows of one token, which run the decode kernel
    # the non-decode rows: (rows, prefix_lens, extend_lens, q_starts (first token of each row in the
    # flattened step), longest new part, any prefix)
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool] | None = None
    q_len: int = 1  # decode steps: query tokens per row (verify steps under graphs: draft tokens + 1)


class TritonAttentionBackend(MHABackend):
    # The kernels; bound from the registry on the first step's device unless set beforehand (tests).
    decode_fn: Callable[..., torch.Tensor] | None = None
    extend_fn: Callable[..., torch.Tensor] | None = None
    prefill_fn: Callable[..., torch.Tensor] | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        self._bind(device)
        prefix, ext = batch.prefix_lens, batch.extend_lens
        starts, seq_lens, total = [], [], 0
        for p, e in zip(prefix, ext, strict=True):
            starts.append(total)
            seq_lens.append(p + e)
            total += e
        decode = bool(ext) and all(e == 1 for e in ext)
        # decode rows: all of them, or in a mixed step its leading single-token rows
        n_dec = len(ext) if decode else next((i for i, e in enumerate(ext) if e != 1), len(ext))
        # every row's table row and length (the decode kernel's), then the non-decode rows' own columns
        cols = [batch.rows_list, seq_lens]
        cols += [c[n_dec:] for c in (batch.rows_list, prefix, ext, starts)]
        parts = columns_to_device(cols, device)
        max_len = max(seq_lens[:n_dec], default=1)
        splits = choose_num_splits(n_dec, self.num_kv_heads, max_len, device) if n_dec else 1
        prefill = (*parts[2:], max(ext[n_dec:]), any(prefix[n_dec:])) if n_dec < len(ext) else None
        batch.attn_meta = _Meta(decode, parts[0], parts[1], splits, n_dec, prefill)

    def _bind(self, device: torch.device) -> None:
        """The kernels from the registry, on the first step's device (tests may set them beforehand)."""
        if self.decode_fn is None:
            self.decode_fn = DECODE_ATTENTION.get(device)
        if self.extend_fn is None:
            self.extend_fn = EXTEND_ATTENTION.get(device)
        if self.prefill_fn is None:
            self.prefill_fn = PREFILL_ATTENTION.get(device)

    supports_cuda_graph = True
    supports_verify_graph = True
    wants_warm_up = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        # non-decode rows: the prefill kernel (whose tiles span whole power-of-two heads)
        self.prefill_kernel = head_dim & (head_dim - 1) == 0

    def prepare_decode_graph(
        self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int, q_len: int = 1
    ) -> None:
        """Split count fixed by the batch size and `max_seq_len`: the kernel reads lengths on the device.
        A verify step's q_len tokens of a row share its K/V reads in the decode kernel's query tile."""
        device = batch.input_ids.device
        self._bind(device)
        b = batch.rows.shape[0]
        splits = choose_num_splits(b, self.num_kv_heads, max_seq_len, device)
        batch.attn_meta = _Meta(True, batch.rows, seq_lens, splits, q_len=q_len)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        cache, meta = batch.kv_pool, batch.attn_meta
        prefill = meta.prefill is not None and self.prefill_kernel
        q = self.rope_and_store(layer, q, k, v, batch, rope, write_kv=prefill)
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        if meta.decode:
            return self.decode_fn(
                q, k_pool, v_pool, batch.req_to_token, meta.rows, meta.seq_lens, self.scale,
                num_splits=meta.num_splits, page_size=self.page_size, q_len=meta.q_len,
            )  # fmt: skip
        # each kernel writes its own rows' tokens of one output
        out = torch.empty_like(q)
        n = meta.num_decode
        if n:  # the decode rows' tokens are q's first n
            self.decode_fn(
                q[:n], k_pool, v_pool, batch.req_to_token, meta.rows[:n], meta.seq_lens[:n], self.scale,
                num_splits=meta.num_splits, out=out[:n], page_size=self.page_size,
            )  # fmt: skip
        if meta.prefill is not None:
            rows, prefix, ext, starts, longest, any_prefix = meta.prefill
            if prefill:
                cached = (k_pool, v_pool, batch.req_to_token, rows, prefix) if any_prefix else None
                self.prefill_fn(q, k, v, starts, ext, self.scale, max_len=longest, out=out, cached=cached)
            else:
                self.extend_fn(
                    q, k_pool, v_pool, batch.req_to_token, rows, prefix, ext, starts, self.scale,
                    max_extend=longest, out=out,
                )  # fmt: skip
        return out

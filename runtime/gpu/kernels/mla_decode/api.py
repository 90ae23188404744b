"""A FlashMLA-signature front end: code written against `flash_mla` runs on whichever `mla_decode`
implementation the registry picks (FlashMLA itself when importable, else ours: TileLang on Hopper,
Triton; else the PyTorch reference), so the two are interchangeable.

    meta, splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, splits,
                                      softmax_scale=scale, causal=True)

q [b, s_q, h_q, 576], k_cache [num_pages, page, 1, 576] (any page size for ours; 64 for FlashMLA),
block_table [b, max_pages] int32, cache_seqlens [b] int32. Returns out [b, s_q, h_q, 512] and lse
[b, h_q, s_q] float32 (natural log). With s_q > 1 and `causal`, query i of a row sees the first
cache_seqlens - (s_q - 1 - i) tokens (speculative / MTP decode), as in FlashMLA. Dense bf16/fp16 KV only:
FP8 KV and sparse (`indices`) calls go to FlashMLA or fail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.kernels.mla_decode import MLA_DECODE
from runtime.gpu.kernels.mla_decode import flash_mla as fm_adapter


def _impl(device: torch.device) -> str:
    return MLA_DECODE.select(device).name


@dataclass
class RowsMeta:
    """Our implementations' metadata, FlashMLA's in kind: each query row's block-table row and KV length,
    built by the first `flash_mla_with_kvcache` call given it and reused by the later ones (every layer
    of a step), so that those launch the kernel alone. Like FlashMLA's, it belongs to one batch (one
    cache_seqlens tensor, s_q and causal flag); with s_q 1 the lengths are cache_seqlens itself, so
    in-place updates of it are seen. The split count is chosen per call on the host."""

    rows: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    key: tuple = ()


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int = 1):
    """(tile scheduler metadata, num_splits): FlashMLA's when it is the chosen implementation, else
    (RowsMeta(), None)."""
    if _impl(cache_seqlens.device) == "flash_mla":
        return fm_adapter.scheduler_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)
    return RowsMeta(), None


def _rows_and_lens(b: int, s_q: int, cache_seqlens: torch.Tensor, causal: bool):
    """Query row i * s_q + j reads block-table row i; with s_q > 1 and `causal` it sees the first
    cache_seqlens[i] - (s_q - 1 - j) tokens. With s_q 1, cache_seqlens is the lengths as it is."""
    rows = torch.arange(b, device=cache_seqlens.device)
    if s_q == 1:
        return rows, cache_seqlens
    lens = cache_seqlens.to(torch.int64).repeat_interleave(s_q)
    if causal:
        lens = (lens - (s_q - 1 - torch.arange(s_q, device=lens.device)).repeat(b)).clamp(min=0)
    return rows.repeat_interleave(s_q), lens


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata=None,
    num_splits=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, s_q, h_q, dim = q.shape
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1, "one latent head per token"
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    impl = _impl(q.device)
    if impl == "flash_mla":
        return fm_adapter.call(
            q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
            scale, causal, **kwargs,
        )  # fmt: skip
    if any(v is not None and v is not False for v in kwargs.values()):
        raise NotImplementedError(f"{impl} mla_decode: only dense bf16/fp16 KV; got {sorted(kwargs)}")
    page = k_cache.shape[1]
    pool = k_cache.view(-1, dim)
    meta = tile_scheduler_metadata if isinstance(tile_scheduler_metadata, RowsMeta) else RowsMeta()
    key = (b, s_q, bool(causal), cache_seqlens.data_ptr())
    if meta.key != key:
        meta.rows, meta.lens = _rows_and_lens(b, s_q, cache_seqlens, bool(causal))
        meta.key = key
    qf = q.reshape(b * s_q, h_q, dim)
    op = MLA_DECODE.named(impl).load()  # every implementation takes page tables
    out, lse = op(
        qf, pool, block_table, meta.rows, meta.lens, scale, head_dim_v, return_lse=True, page_size=page
    )
    return out.view(b, s_q, h_q, head_dim_v), lse.view(b, s_q, h_q).transpose(1, 2)

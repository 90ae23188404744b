"""Adapters to DeepSeek's FlashMLA (`flash_mla`, built from source; not a working PyPI build).

`mla_decode` is the op signature (req_to_token rows) mapped onto `flash_mla_with_kvcache`. FlashMLA
reads the pool as pages of 64 tokens through a block table, so this needs the engine's allocator to
hand out page-aligned slots: token p of a row lives in slot `page * 64 + p % 64` of its p // 64-th page
(true for `testing.mla_case(page_size=64)`). The block table is derived from req_to_token on the
device (every 64th slot // 64); nothing syncs.

Both FlashMLA API generations are handled: v1 (`get_mla_metadata(cache_seqlens, h_q, 1)` returning
(tile metadata, num_splits)) and the current one (`get_mla_metadata()` returning a scheduling object
filled on first use, `num_splits` None)."""

from __future__ import annotations

import inspect

import torch

from runtime.gpu.kernels.mla_decode.reference import page_table, pool_2d

FLASH_MLA_PAGE = 64


def _module():
    import flash_mla

    return flash_mla


def scheduler_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int = 1):
    """(tile scheduler metadata, num_splits) for either FlashMLA API generation."""
    fm = _module()
    params = inspect.signature(fm.get_mla_metadata).parameters.values()
    if any(p.default is inspect.Parameter.empty and p.kind != p.VAR_POSITIONAL for p in params):
        return fm.get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)  # v1
    return fm.get_mla_metadata(), None


def call(q4, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, scale, causal, **kw):
    """flash_mla.flash_mla_with_kvcache with the metadata of either API generation -> (out, lse)."""
    extra = {} if num_splits is None else {"num_splits": num_splits}
    return _module().flash_mla_with_kvcache(
        q4, k_cache, block_table, cache_seqlens, head_dim_v, meta,
        softmax_scale=scale, causal=causal, **extra, **kw,
    )  # fmt: skip


def mla_decode(
    q, latent_pool, req_to_token, rows, seq_lens, scale, kv_lora_rank=512, num_splits=None, out=None,
    return_lse=False, page_size=1, q_len=1,
):  # fmt: skip
    """`MlaDecode` through FlashMLA (page-aligned slots, see the module doc). `page_size` 64:
    req_to_token is already the block table; 1: it is derived here. `q_len` > 1 is FlashMLA's s_q with
    its causal mask (the row's last s_q positions)."""
    assert page_size in (1, FLASH_MLA_PAGE), f"FlashMLA reads 64-token pages, not {page_size}"
    pool = pool_2d(latent_pool)
    tokens, num_heads, dim = q.shape
    batch = tokens // q_len
    k_cache = pool.view(-1, FLASH_MLA_PAGE, 1, dim)
    table = req_to_token if page_size == FLASH_MLA_PAGE else page_table(req_to_token, FLASH_MLA_PAGE)
    block_table = table.index_select(0, rows).to(torch.int32)
    cache_seqlens = seq_lens.to(torch.int32)
    meta, splits = scheduler_metadata(cache_seqlens, num_heads * q_len, 1)
    o, lse = call(
        q.view(batch, q_len, num_heads, dim), k_cache, block_table, cache_seqlens, kv_lora_rank, meta, splits,
        scale, q_len > 1,
    )  # fmt: skip
    o = o.reshape(tokens, num_heads, kv_lora_rank)  # [B, s_q, H, r]
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse.transpose(1, 2).reshape(tokens, num_heads)) if return_lse else o

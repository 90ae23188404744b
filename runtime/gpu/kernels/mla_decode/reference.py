"""MLA decode (absorbed form) over the paged latent cache in plain PyTorch, row by row in float32: the
truth for the kernels.

Every query head attends the same latent rows `[c (kv_lora_rank) | k_pe (rope)]` (one latent "head",
d_qk = kv_lora_rank + rope, 576 for DeepSeek-V2/V3); the values are the first kv_lora_rank dims of the
same rows (d_v = 512)."""

from __future__ import annotations

import math

import torch


def pool_2d(latent_pool: torch.Tensor) -> torch.Tensor:
    """[slots, D] or [slots, 1, D] (`LatentKVPool.kv[layer]`) -> a [slots, D] view."""
    if latent_pool.dim() == 3:
        assert latent_pool.shape[1] == 1, "the latent pool has one head"
        return latent_pool[:, 0]
    return latent_pool


def per_token_slots(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """A page table [rows, pages] as the per-token table [rows, pages * page_size]."""
    pos = torch.arange(page_table.shape[1] * page_size, device=page_table.device)
    return page_table[:, pos // page_size] * page_size + pos % page_size


def page_table(req_to_token: torch.Tensor, page_size: int) -> torch.Tensor:
    """The per-token table of a pool whose slots come in page-aligned runs of `page_size` (a multiple
    of it works too) as a page table: every page_size-th slot // page_size. On the device, no sync."""
    return torch.div(req_to_token[:, ::page_size], page_size, rounding_mode="floor")


def mla_decode(
    q, latent_pool, req_to_token, rows, seq_lens, scale, kv_lora_rank=512, num_splits=None, out=None,
    return_lse=False, page_size=1, q_len=1,
):  # fmt: skip
    """`MlaDecode`, row by row (q_len query tokens each, causal over the row's last q_len positions)."""
    pool = pool_2d(latent_pool)
    if page_size > 1:
        req_to_token = per_token_slots(req_to_token, page_size)
    tokens, hq, _ = q.shape
    out = q.new_empty(tokens, hq, kv_lora_rank) if out is None else out
    lse = torch.empty(tokens, hq, dtype=torch.float32, device=q.device)
    for b, (row, n) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        for i in range(q_len):
            t, keys = b * q_len + i, n - q_len + 1 + i
            if keys <= 0:
                out[t] = 0
                lse[t] = -math.inf
                continue
            lat = pool[req_to_token[row, :keys]].float()  # [S, D]
            s = (q[t].float() @ lat.T) * scale  # [Hq, S]
            lse[t] = torch.logsumexp(s, dim=-1)
            out[t] = (torch.softmax(s, dim=-1) @ lat[:, :kv_lora_rank]).to(out.dtype)
    return (out, lse) if return_lse else out

"""Sparse attention over selected rows (DeepSeek-V4) in plain PyTorch, float32: the truth for the kernels.

The contract is FlashMLA's `flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)`
with values = keys (d_v = d), plus FlashMLA's optional second KV source (`extra_k_cache`). Shared-KV
MQA: every query head of token t attends the rows of `kv` that `indices[t]` names (-1: no row), as keys
and as values, plus a per-head sink logit that takes probability mass but adds no value (gpt-oss style,
FlashMLA's `attn_sink`): out = sum_k p_k kv_k with p = softmax over [scores | sink], sink column dropped.

DeepSeek-V4 (runtime/gpu/models/deepseek_v4/attention.py) selects, per query, its sliding window of K=V rows and,
on CSA / HCA layers, compressed entries (CSA: the Lightning Indexer's top-k; HCA: every causal entry);
the two can come from two pools (`kv`, `extra_kv`), attended in one softmax."""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 26  # float32 gathered rows per token chunk (256 MB)


def rows_2d(kv: torch.Tensor) -> torch.Tensor:
    """[S, d] or FlashMLA's [S, 1, d] (one kv head) -> [S, d]."""
    if kv.dim() == 3:
        assert kv.shape[1] == 1, "shared-KV MQA: one kv head"
        return kv[:, 0]
    return kv


def indices_2d(indices: torch.Tensor) -> torch.Tensor:
    """[T, K] or FlashMLA's [T, 1, K] -> [T, K]."""
    if indices.dim() == 3:
        assert indices.shape[1] == 1, "shared-KV MQA: one kv head"
        return indices[:, 0]
    return indices


def sparse_attention(
    q, kv, indices, sinks, scale, topk_length=None, extra_kv=None, extra_indices=None, extra_topk_length=None,
    out=None,
):  # fmt: skip
    """`SparseAttention`, a chunk of tokens at a time."""
    tokens, heads, dim = q.shape
    out = q.new_empty(tokens, heads, dim) if out is None else out
    sources = [(kv, indices, topk_length)]
    if extra_kv is not None:
        sources.append((extra_kv, extra_indices, extra_topk_length))
    width = sum(indices_2d(idx).shape[1] for _, idx, _ in sources)
    chunk = max(1, _CHUNK_ELEMS // max(1, width * dim))
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        keys, valid = [], []
        for pool, idx, length in sources:
            pool, idx = rows_2d(pool), indices_2d(idx)[t0:t1].long()
            ok = idx >= 0
            if length is not None:
                ok &= torch.arange(idx.shape[1], device=idx.device)[None, :] < length[t0:t1, None]
            rows = pool[torch.where(ok, idx, 0)].float()  # [t, K, d]
            keys.append(rows.masked_fill(~ok[..., None], 0.0))  # unselected rows may hold anything
            valid.append(ok)
        k, ok = torch.cat(keys, 1), torch.cat(valid, 1)
        logits = torch.einsum("thd,tkd->thk", q[t0:t1].float(), k) * scale
        logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, heads, 1).expand(t1 - t0, heads, 1)
            logits = torch.cat([logits, sink], dim=-1)
        probs = logits.softmax(-1)[..., : k.shape[1]]
        probs = probs.masked_fill(~ok[:, None, :], 0.0)  # no valid row and no sink: NaN -> 0
        out[t0:t1] = torch.einsum("thk,tkd->thd", probs, k).to(out.dtype)
    return out

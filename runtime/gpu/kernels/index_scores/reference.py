"""Lightning Indexer scores in plain PyTorch, float32: the truth for the kernel (`IndexScores`).

The formula is DeepSeek-V4's (transformers' `DeepseekV4Indexer`): score[t, n] = sum_h w[t, h] *
ReLU(q[t, h] . k[n]). Heads are summed a chunk at a time, so the largest intermediate is
[T, heads in a chunk, N] of at most _CHUNK_ELEMS, whatever T x H x N is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CHUNK_ELEMS = 1 << 26  # float32 scores per head chunk (256 MB)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor):
    """`IndexScores`."""
    tokens, heads, _ = q.shape
    n = keys.shape[0]
    k = keys.float()
    chunk = max(1, _CHUNK_ELEMS // max(1, tokens * n))
    out = torch.zeros(tokens, n, dtype=torch.float32, device=q.device)
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        out += (F.relu(torch.einsum("thc,nc->thn", q[:, h0:h1].float(), k)) * weights[:, h0:h1, None]).sum(1)
    hidden = torch.arange(n, device=q.device)[None, :] >= visible[:, None]
    return out.masked_fill(hidden, float("-inf"))

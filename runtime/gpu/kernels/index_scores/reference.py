"""Lightning Indexer scores in plain PyTorch, float32: the truth for the kernels (`IndexScores`,
`RowIndexScores`).

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


def row_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
):
    """`RowIndexScores`: each group's keys gathered ([G, W, c] float32), then `index_scores`' sum per
    group; table entries past a group's largest visible read row 0 instead."""
    tokens, heads, c = q.shape
    groups, width = table.shape
    q_len = tokens // max(1, groups)
    seen = visible.view(groups, q_len).amax(1)
    w = torch.arange(width, device=q.device)
    rows = torch.where(w[None, :] < seen[:, None], table.long(), 0)
    k = keys[rows].float()  # [G, W, c]
    chunk = max(1, _CHUNK_ELEMS // max(1, tokens * width))
    out = torch.zeros(tokens, width, dtype=torch.float32, device=q.device)
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        dots = torch.einsum("gjhc,gwc->gjhw", q[:, h0:h1].float().view(groups, q_len, h1 - h0, c), k)
        out += (F.relu(dots.reshape(tokens, h1 - h0, width)) * weights[:, h0:h1, None]).sum(1)
    return out.masked_fill(w[None, :] >= visible[:, None], float("-inf"))

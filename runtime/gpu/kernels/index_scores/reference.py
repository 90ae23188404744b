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
    k = keys.float()
    return _masked_head_sum(q, weights, k.shape[0], visible, lambda qh: torch.einsum("thc,nc->thn", qh, k))


def row_index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, visible: torch.Tensor
):
    """`RowIndexScores`: each group's keys gathered ([G, W, c] float32), then the same head sum per
    group; table entries past a group's largest visible read row 0 instead."""
    groups, width = table.shape
    q_len = q.shape[0] // max(1, groups)
    seen = visible.view(groups, q_len).amax(1)
    w = torch.arange(width, device=q.device)
    k = keys[torch.where(w[None, :] < seen[:, None], table.long(), 0)].float()  # [G, W, c]

    def dots(qh: torch.Tensor) -> torch.Tensor:  # [T, h, c] -> [T, h, W], each group's own keys
        t, h, c = qh.shape
        return torch.einsum("gjhc,gwc->gjhw", qh.view(groups, q_len, h, c), k).reshape(t, h, width)

    return _masked_head_sum(q, weights, width, visible, dots)


def _masked_head_sum(q, weights, width: int, visible: torch.Tensor, dots) -> torch.Tensor:  # noqa: ANN001
    """sum_h weights[t, h] ReLU(dots(q)[t, h, n]) over [T, width] entries, heads a chunk at a time
    (`dots` maps float32 q [T, h, c] to [T, h, width]), -inf where n >= visible[t]."""
    tokens, heads, _ = q.shape
    chunk = max(1, _CHUNK_ELEMS // max(1, tokens * width))
    out = torch.zeros(tokens, width, dtype=torch.float32, device=q.device)
    for h0 in range(0, heads, chunk):
        h1 = min(heads, h0 + chunk)
        out += (F.relu(dots(q[:, h0:h1].float())) * weights[:, h0:h1, None]).sum(1)
    hidden = torch.arange(width, device=q.device)[None, :] >= visible[:, None]
    return out.masked_fill(hidden, float("-inf"))

"""Tensor-parallel layers: each rank holds a slice of a layer's weight and the group's collectives make
the whole (Megatron's split, as SGLang and vLLM use it).

- column-parallel (`MergedLinear` with `ranges`): a slice of the output features; no collective, the
  next row-parallel layer consumes the slice;
- `RowParallelLinear`: a slice of the input features; the partial products are summed by all-reduce;
- `VocabParallelEmbedding`: a slice of the vocabulary's rows; a token outside it embeds to zero and the
  all-reduce adds the owner's row;
- `ParallelLMHead`: a slice of the vocabulary's logits, gathered in rank order.

Each module names the slice of its checkpoint tensors it holds in `tp_slices` (parameter -> (dim, start,
size) in the checkpoint tensor), so the loader reads only that slice from the safetensors file: no rank
reads the whole checkpoint. The vocabulary is split in equal parts of ceil(V / tp) rows; the last rank's
part is zero-padded past V (`tp_padded`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.gpu import distributed


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when n items split into `parts` as evenly as possible (the first
    n % parts parts get one more)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


def head_split(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, int, int]:
    """(q_start, q_heads, kv_start, kv_heads) of this rank for grouped-query attention. With at least as
    many KV heads as ranks, whole KV groups (a KV head and its query heads) split as evenly as possible,
    so 3 KV heads over 2 ranks give 2 and 1; with fewer, each rank takes an equal share of the query heads
    and a copy of the one KV head they read."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        kv_start, kv_n = split(num_kv_heads, tp_size, tp_rank)
        return kv_start * group, kv_n * group, kv_start, kv_n
    if num_heads % tp_size or tp_size % num_kv_heads:
        raise ValueError(
            f"{num_heads} attention heads and {num_kv_heads} KV heads do not split over {tp_size} ranks"
        )
    q_n = num_heads // tp_size
    q_start = tp_rank * q_n
    return q_start, q_n, q_start // group, 1


class RowParallelLinear(nn.Linear):
    """y = x W^T (+ b) where this rank holds columns [start, start + size) of W and the matching slice of
    x; the partial products are summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, in_range: tuple[int, int]) -> None:
        start, size = in_range
        super().__init__(size, out_features, bias=bias)
        self.tp_slices = {"weight": (1, start, size)} if size != in_features else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if distributed.tp().size == 1:
            return super().forward(x)
        y = distributed.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _vocab_part(vocab_size: int) -> tuple[int, int, int]:
    """(rows per rank, this rank's first row, its rows inside the vocabulary)."""
    g = distributed.tp()
    per = -(-vocab_size // g.size)
    start = g.rank * per
    return per, start, max(0, min(per, vocab_size - start))


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random init: a served model's rows come from the checkpoint or from
    `init_dummy_weights`. (Built on the meta device, `nn.init.normal_` runs torch's Python references,
    whose first call imports torch._dynamo: about 2 s of every engine start on the CPU.)"""

    def reset_parameters(self) -> None:
        return


class VocabParallelEmbedding(Embedding):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        per, start, valid = _vocab_part(vocab_size)
        super().__init__(per, hidden)
        self.vocab_size, self.start = vocab_size, start
        self.tp_slices = {"weight": (0, start, valid)} if per != vocab_size else {}
        self.tp_padded = per != valid

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if distributed.tp().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return distributed.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class ParallelLMHead(nn.Linear):
    """Logits of every token over the whole vocabulary: each rank computes its rows', then all-gather."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        per, start, valid = _vocab_part(vocab_size)
        super().__init__(hidden, per, bias=False)
        self.vocab_size = vocab_size
        self.tp_slices = {"weight": (0, start, valid)} if per != vocab_size else {}
        self.tp_padded = per != valid

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if distributed.tp().size == 1:
            return logits
        return distributed.all_gather(logits, dim=-1)[:, : self.vocab_size]


class ColumnParallelLinear(nn.Linear):
    """y = x W^T (+ b) for rows [start, start + size) of W (a slice of the output features); no
    collective: a row-parallel layer, or a per-head computation, consumes the slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, out_range: tuple[int, int]) -> None:
        start, size = out_range
        super().__init__(in_features, size, bias=bias)
        self.tp_slices = {}
        if size != out_features:
            self.tp_slices = {"weight": (0, start, size)} | ({"bias": (0, start, size)} if bias else {})

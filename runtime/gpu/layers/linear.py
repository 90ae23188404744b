from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """Several projections of one input stacked into one matmul (q|k|v, gate|up).

    Checkpoints store the parts separately; `shard_names` and `out_sizes` tell the loader where each
    part goes along the output dimension. Under tensor parallelism (column-parallel) a rank holds rows
    `starts[i]` .. `starts[i] + out_sizes[i]` of each checkpoint part (`shard_source`)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        shard_names: list[str],
        bias: bool = False,
        starts: list[int] | None = None,
    ):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)
        self.shard_names = list(shard_names)
        self.starts = list(starts) if starts is not None else None

    def shard_offset(self, shard: str) -> tuple[int, int]:
        i = self.shard_names.index(shard)
        return sum(self.out_sizes[:i]), self.out_sizes[i]

    def shard_source(self, shard: str) -> tuple[int, int] | None:
        """(first row, rows) of checkpoint part `shard` this rank holds; None: all of it."""
        if self.starts is None:
            return None
        i = self.shard_names.index(shard)
        return self.starts[i], self.out_sizes[i]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.out_sizes, dim=-1)

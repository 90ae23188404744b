"""What one forward step needs besides the weights: token inputs, KV destinations, attention metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.gpu.attention.base import AttentionBackend
    from runtime.gpu.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """A flattened step: rows' new tokens concatenated in plan order.

    Host-side lists (`prefix_lens`, `extend_lens`) are kept so backends can plan without device syncs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_loc: torch.Tensor  # [T] KV slot of each new token
    rows: torch.Tensor  # [B] req_to_token rows
    rows_list: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: torch.Tensor  # [max_reqs + 1, max_model_len]
    kv_cache: KVCache
    attn_backend: AttentionBackend
    attn_meta: Any = field(default=None)  # filled by attn_backend.prepare(), shared by all layers
    # per row, leading tokens that only rebuild the row's state before a cached prefix (StepPlan.replay);
    # empty: none
    replay_lens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def token_positions(prefix_lens: list[int], extend_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors for a step's flattened tokens: each token's position in its row, and each row's
    first token index (row i's new tokens are positions prefix_lens[i] .. + extend_lens[i] - 1)."""
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    starts = torch.cumsum(ext, 0) - ext
    positions = torch.repeat_interleave(torch.tensor(prefix_lens, dtype=torch.int64) - starts, ext)
    return positions + torch.arange(len(positions)), starts


def columns_to_device(cols: list[torch.Tensor | list[int]], device: torch.device) -> list[torch.Tensor]:
    """A step's int64 columns on `device` through one host tensor and one non-blocking copy, each column
    starting 16-byte aligned (padded to an even length). Triton compiles a kernel variant per pointer
    alignment: columns packed end to end would shift with the lengths before them and compile new
    variants mid-run, a second each (docs/PERF.md, eighth and eleventh sessions)."""
    host = [torch.as_tensor(c, dtype=torch.int64) for c in cols]
    padded = [torch.nn.functional.pad(c, (0, len(c) & 1)) for c in host]
    parts = torch.cat(padded).to(device, non_blocking=True).split([len(c) for c in padded])
    return [p[: len(c)] for p, c in zip(parts, host, strict=True)]

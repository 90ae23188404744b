"""What one forward step needs besides the weights: token inputs, KV destinations, the request tables,
and the attention backend's metadata; built the same way for eager steps and CUDA-graph replays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.gpu.kv_pool import KVPool


@dataclass(frozen=True)
class StepTables:
    """The worker's per-request device tables, indexed by request row (row 0 is padding)."""

    req_to_token: torch.Tensor  # [rows, max_model_len] KV slot of each position of each request
    # [rows, 1 + max_draft]: column 0 each request's last sampled token, then the drafts its drafter
    # proposed for its next step (speculative decoding). Inputs read from here on the device, so a step
    # can be planned before the previous one's tokens reach the host.
    fed: torch.Tensor
    # [rows] speculative decoding (None without): the positions each request's last verify step wrote and
    # rejected. A step planned before those counts reached the host assumed them accepted
    # (`StepPlan.assume_accepted`) and moves its row back by this many positions on the device.
    rejected: torch.Tensor | None = None

    @property
    def last_token(self) -> torch.Tensor:
        return self.fed[:, 0]

    @classmethod
    def allocate(cls, rows: int, max_model_len: int, device: torch.device, max_draft: int = 0) -> StepTables:
        return cls(
            torch.zeros(rows, max_model_len, dtype=torch.int64, device=device),
            torch.zeros(rows, 1 + max_draft, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device) if max_draft else None,
        )

    def behind(self, rows: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        """Positions to move back, per entry of `rows`: its row's rejected drafts where `ahead` (1: the
        entry's plan assumed them accepted), else 0. Device work only (graph-safe)."""
        return self.rejected[rows] * ahead


@dataclass
class ForwardBatch:
    """A flattened step: rows' new tokens concatenated in plan order.

    Host-side lists (`prefix_lens`, `extend_lens`) are kept so backends can plan without device syncs;
    a CUDA-graph step leaves them empty (its backend metadata comes from device tensors alone)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_loc: torch.Tensor  # [T] KV slot of each new token
    rows: torch.Tensor  # [B] req_to_token rows
    rows_list: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: torch.Tensor  # [max_reqs + 1, max_model_len]
    kv_pool: KVPool
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare, shared by all layers
    # per row, leading tokens that only rebuild the row's state before a cached prefix (StepPlan.replay);
    # empty: none
    replay_lens: list[int] = field(default_factory=list)
    # layer index -> that layer's output ([T, D]; DeepSeek-V4: its streams [T, n, D]), filled by the model
    # for the layers named here (the DSpark drafter's context features); None: no layer is tapped
    taps: dict[int, torch.Tensor | None] | None = None
    engram: Any = field(default=None)  # the step's Engram rows (runtime/engram/placement.EngramRows)
    # [T] each token's request row (`make_batch` sets it; a verify graph's padding places use row 0)
    token_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def tapped(self, layer: int) -> bool:
        return self.taps is not None and layer in self.taps


@dataclass(frozen=True)
class GraphStep:
    """A CUDA graph step's shape, for work planned from device tensors alone inside it (a hidden-state
    drafter's own layer, `Drafter.capture`): each row's length with its new tokens [B], the graph's
    context bucket, and the token places per row."""

    seq_lens: torch.Tensor
    max_seq_len: int
    q_len: int


def make_batch(
    tables: StepTables,
    pool: KVPool,
    ids: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    token_rows: torch.Tensor,
    fed_col: torch.Tensor,
    rows: torch.Tensor,
    host: tuple[list[int], list[int], list[int], list[int]] | None = None,
    back: torch.Tensor | None = None,
) -> ForwardBatch:
    """The step's batch from its device columns, for the eager and the graph paths alike: a token with
    `fed_col` c >= 0 reads column c of its row's `fed` table (0: the last sampled token, j: draft j), so
    a plan can be sent before the previous step's tokens reach the host; -1 keeps the plan's id. Every new
    token's KV slot is entered in its row's table. `token_rows` [T] is each token's request row; `host`:
    (rows, prefix_lens, extend_lens, replay) lists.

    `back` [T] (graph steps of a speculating runner): positions each token moves back from its planned
    one (`StepTables.behind`); its KV slot is then the one its row's table holds at the real position
    (a rejected draft's, or one of the plan's entered just before)."""
    ids = torch.where(fed_col >= 0, tables.fed[token_rows, fed_col.clamp(min=0)], ids)
    tables.req_to_token[token_rows, positions] = out_loc
    if back is not None:
        positions = positions - back
        out_loc = tables.req_to_token[token_rows, positions]
    rows_list, prefix, extend, replay = host or ([], [], [], [])
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        out_loc=out_loc,
        rows=rows,
        rows_list=rows_list,
        prefix_lens=prefix,
        extend_lens=extend,
        req_to_token=tables.req_to_token,
        kv_pool=pool,
        replay_lens=replay,
        token_rows=token_rows,
    )


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
    variants mid-run, a second each."""
    host = [torch.as_tensor(c, dtype=torch.int64) for c in cols]
    padded = [torch.nn.functional.pad(c, (0, len(c) & 1)) for c in host]
    parts = torch.cat(padded).to(device, non_blocking=True).split([len(c) for c in padded])
    return [p[: len(c)] for p, c in zip(parts, host, strict=True)]

"""DeepSeek-V4's KV pool: paged pools the radix cache shares, plus a small state per request row.

Paged, per CSA / HCA layer, addressed through the scheduler's token slots (so drawn from its page budget
and cached by the radix tree with the tokens):
- the compressed entries: window w of a request (positions [w * rate, (w + 1) * rate)) keeps its entry at
  `entries[req_to_token[row, w * rate] // rate]`;
- CSA layers: the Lightning Indexer's keys, the same way.
That address is one entry per window and never shared by two windows because the scheduler lays pages
out by position (position p of a request at offset p % page_size of its page) and page_size is a multiple
of every rate (`page_multiple`; `check_plan` refuses plans that break it). An entry is written once, by
the step that closes its window, and only read afterwards: a cached prefix's entries are shared as is.

Per row (bounded size, not cached; rebuilt by replay on a prefix hit, see attention.py):
- every layer: a ring of the last `sliding_window` roped K=V rows (position p at p % window);
- CSA / HCA layers: the compressor's tail, the raw (kv, gate) projections of the tokens it still needs
  (`Compressor.tail_len`, by position modulo that length), and the same for the indexer.
`RowState.start` is the first position the row's state covers: attention and compressors never read a
ring or tail position below it, so a reused row never sees its previous request's state.

The per-row state is allocated up front for every request row (`rows`: the runner's max_reqs + 1), one
tensor per layer and kind indexed by row (`rings[layer]` [rows, window, head_dim], tails likewise), so
its memory is reserved when the server starts and a row's state lives at a fixed address (what CUDA
graphs over the decode step will need); a `RowState` is a set of views of the row's slices. Each layer's
rings are the head of one flat tensor (`window_keys`) whose tail is a step's scratch: the batched path
(attention_decode.py) keeps there the keys a verify block's later tokens overwrite in the ring while its
earlier tokens still attend them, so one kernel source holds every key a token's window needs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.gpu.forward_batch import token_positions
from runtime.gpu.kv_pool import KVPool, KVPoolSpec, RequestKV, SlotTensor, dtype_bytes, zeroed
from runtime.gpu.models.deepseek_v4.compressor import Compressor
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope
from runtime.mailbox.messages import StepPlan


class V4Layer(Protocol):
    """What the pool and the attention backends read of a V4 attention layer."""

    layer_id: int
    compressor: Compressor | None
    rope: InterleavedRope
    sinks: torch.Tensor


@dataclass
class Tail:
    kv: torch.Tensor  # [tail_len, width] raw projections, by position % tail_len
    gate: torch.Tensor


@dataclass
class LayerRow:
    window: torch.Tensor  # [sliding_window, head_dim]
    compressor: Tail | None = None
    indexer: Tail | None = None


@dataclass
class RowState:
    start: int  # first position this row's ring and tails hold (0, or where a prefix-hit replay began)
    layers: dict[int, LayerRow]  # by layer id (a pool may hold some layers only: the MTP drafter's)


class V4KVPool(KVPool):
    def __init__(self, config, layers: list[V4Layer], spec: KVPoolSpec) -> None:
        self.config, self.layers = config, layers
        self.max_positions, self.dtype, self.device = spec.max_positions, spec.dtype, spec.device
        self.num_slots, self.num_rows = spec.num_slots, spec.num_rows
        num_slots, rows = spec.num_slots, spec.num_rows
        self.rows: dict[int, RowState] = {}  # the rows holding a request
        # RowState.start of every row on the device, for decode steps that read it without the host
        # (attention_decode.py); row 0, the padding row of CUDA-graph batches, stays at 0
        self.starts = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.entries: dict[int, torch.Tensor] = {}  # layer id -> [num_slots // rate, head_dim]
        self.index_keys: dict[int, torch.Tensor] = {}  # CSA layer id -> [num_slots // rate, index_head_dim]
        self.rings: dict[int, torch.Tensor] = {}  # layer id -> [rows, sliding_window, head_dim]
        # layer id -> [rows * sliding_window + scratch, head_dim]: the rings flattened, then a scratch row
        # per token of a batched step (up to max_verify_block a row) for the ring key it overwrites
        self.window_keys: dict[int, torch.Tensor] = {}
        self.tails: dict[int, Tail] = {}  # compressor layer id -> [rows, tail_len, width] kv and gate
        self.index_tails: dict[int, Tail] = {}  # CSA layer id -> the indexer's, likewise
        cfg, rates = config, [1]
        # A verify block's positions must land on distinct ring and tail entries (by position modulo their
        # lengths), so that restoring the rejected ones cannot touch an accepted one.
        comps = [a.compressor for a in layers if a.compressor is not None]
        comps += [c.indexer for c in comps if c.indexer is not None]
        self.max_verify_block = min([cfg.sliding_window, *(c.tail_len for c in comps)])
        self.scratch_start = rows * cfg.sliding_window  # the scratch's first row in `window_keys`
        for attn in layers:
            lid = attn.layer_id
            keys = self._zeros(self.scratch_start + rows * self.max_verify_block, cfg.head_dim)
            self.window_keys[lid] = keys
            self.rings[lid] = keys[: self.scratch_start].view(rows, cfg.sliding_window, cfg.head_dim)
            comp = attn.compressor
            if comp is None:
                continue
            rates.append(comp.rate)
            self.entries[lid] = self._zeros(num_slots // comp.rate, comp.dim)
            self.tails[lid] = self._tail(rows, comp)
            if comp.indexer is not None:
                self.index_keys[lid] = self._zeros(num_slots // comp.rate, comp.indexer.dim)
                self.index_tails[lid] = self._tail(rows, comp.indexer)
        self.page_multiple = math.lcm(*rates)  # page sizes must be multiples of this
        self.rates = sorted(set(rates) - {1})  # the compressors' rates

    def _zeros(self, *shape: int) -> torch.Tensor:
        return zeroed(shape, self.dtype, self.device)

    def _tail(self, rows: int, comp: Compressor) -> Tail:
        return Tail(*(self._zeros(rows, comp.tail_len, comp.width) for _ in range(2)))

    # ------------------------------------------------------------------ rows

    def reset_row(self, row: int, start: int) -> None:
        """The request in `row` (re)builds its state from position `start` (0, or a replay's first).
        Nothing is zeroed: `start` bounds every read of the row's slices."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"row {row} is outside the {self.num_rows} rows the V4 state was sized for")
        self.starts[row] = start
        state = self.rows.get(row)
        if state is not None:
            state.start = start
            return
        layers = {}
        for attn in self.layers:
            lid = attn.layer_id
            layer = LayerRow(self.rings[lid][row])
            if lid in self.tails:
                layer.compressor = Tail(self.tails[lid].kv[row], self.tails[lid].gate[row])
            if lid in self.index_tails:
                layer.indexer = Tail(self.index_tails[lid].kv[row], self.index_tails[lid].gate[row])
            layers[lid] = layer
        self.rows[row] = RowState(start, layers)

    def release_row(self, row: int) -> None:
        """The request in `row` left (the next request there starts with `reset_row`)."""
        self.rows.pop(row, None)

    def row(self, row: int) -> RowState:
        if row not in self.rows:
            raise NotImplementedError(
                f"row {row} continues a request whose V4 state is not here (a cached prefix must be replayed)"
            )
        return self.rows[row]

    # ------------------------------------------------------------------ what the engine asks

    def replay_tokens(self, requested: int | None, exact: bool) -> int:
        """Tokens before a prefix hit a row recomputes to rebuild its ring and tails: `requested`
        (default: the sliding window), at least what the state needs (the window's keys below the hit
        and, for overlapping compressors, the last closed window's raw tokens); every position in exact
        mode."""
        if exact:
            return self.max_positions
        needed = self.config.sliding_window - 1
        for attn in self.layers:
            if attn.compressor is not None and attn.compressor.overlap:
                needed = max(needed, attn.compressor.rate)
        return max(needed, requested if requested is not None else self.config.sliding_window)

    def check_plan(self, plan: StepPlan) -> None:
        """Refuse slots that break the pools' addressing (a token off its position's offset mod rate)."""
        m = self.page_multiple
        if m == 1:
            return
        positions, starts = token_positions(plan.prefix_lens, plan.extend_lens)
        bad = torch.nonzero((torch.tensor(plan.out_loc, dtype=torch.int64) - positions) % m).flatten()
        if len(bad):  # one vectorized pass: a Python loop over every slot cost about 1 ms at 8K tokens
            row = plan.rows[int(torch.searchsorted(starts, bad[0], right=True)) - 1]
            raise ValueError(
                f"step {plan.step}: row {row} has KV slots not aligned to positions modulo {m}; "
                f"DeepSeek-V4 needs position-aligned pages of a multiple of {m} tokens"
            )

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_for(self.config, self.dtype)

    def slot_tensors(self) -> list[SlotTensor]:
        rate = {a.layer_id: a.compressor.rate for a in self.layers if a.compressor is not None}
        out = [SlotTensor(f"entries.{lid}", t, rate[lid]) for lid, t in self.entries.items()]
        return out + [SlotTensor(f"index_keys.{lid}", t, rate[lid]) for lid, t in self.index_keys.items()]

    def row_state(self, row: int) -> RequestKV:
        """The row's ring and compressor / indexer tails (by position modulo their lengths), and `start`."""
        out = {"start": self.starts[row : row + 1].clone()}
        for lid, ring in self.rings.items():
            out[f"ring.{lid}"] = ring[row].clone()
        for kind, tails in (("tail", self.tails), ("index_tail", self.index_tails)):
            for lid, tail in tails.items():
                out[f"{kind}.{lid}.kv"], out[f"{kind}.{lid}.gate"] = (
                    tail.kv[row].clone(),
                    tail.gate[row].clone(),
                )
        return out

    def load_row_state(self, row: int, state: RequestKV, start: int) -> None:
        expected = set(self.row_state(0))
        if set(state) != expected:
            raise ValueError(f"V4 row state has {sorted(state)}, this pool needs {sorted(expected)}")
        self.reset_row(row, int(state["start"][0]))
        for lid, ring in self.rings.items():
            ring[row] = state[f"ring.{lid}"].to(ring.device, ring.dtype)
        for kind, tails in (("tail", self.tails), ("index_tail", self.index_tails)):
            for lid, tail in tails.items():
                tail.kv[row] = state[f"{kind}.{lid}.kv"].to(tail.kv.device, tail.kv.dtype)
                tail.gate[row] = state[f"{kind}.{lid}.gate"].to(tail.gate.device, tail.gate.dtype)

    def truncate(self, row: int, length: int, n: int) -> None:
        """Paged entries need nothing (an entry is written by the token that closes its window, and a
        dropped window is written again when it closes again, before any query can see it). The ring and
        the tails were rolled back by the verify step itself (`restore_rejected`)."""
        super().truncate(row, length, n)

    # ------------------------------------------------------------------ rejected drafts

    def _row_tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor written in place by position: rings, compressor and indexer tails."""
        out = list(self.rings.values())
        for tails in (self.tails, self.index_tails):
            for t in tails.values():
                out += [t.kv, t.gate]
        return out

    def save_blocks(self, rows: torch.Tensor, first: torch.Tensor, width: int) -> object:
        pos = first[:, None] + torch.arange(width, device=first.device)  # [B, width]
        saved = []
        for t in self._row_tensors():
            idx = pos % t.shape[1]
            saved.append((t, idx, t[rows[:, None], idx].clone()))
        return rows, saved

    def restore_rejected(self, saved: object, kept: torch.Tensor) -> None:
        rows, entries = saved
        for t, idx, old in entries:
            rejected = torch.arange(idx.shape[1], device=idx.device)[None, :] >= kept[:, None]
            current = t[rows[:, None], idx]
            t[rows[:, None], idx] = torch.where(rejected[..., None], old, current)

    @staticmethod
    def bytes_for(config, dtype: torch.dtype) -> int:
        """Paged bytes per token slot: compressed entries (+ indexer keys), one per `rate` slots."""
        size = dtype_bytes(dtype)
        rates = config.compress_rates
        total = 0.0
        for kind in config.layer_types:
            if kind == "compressed_sparse_attention":
                total += (config.head_dim + config.index_head_dim) / rates[kind]
            elif kind == "heavily_compressed_attention":
                total += config.head_dim / rates[kind]
        return max(1, math.ceil(total * size))

    @staticmethod
    def bytes_per_row(config, dtype: torch.dtype) -> int:
        """Per running request, outside the page budget: rings (with their share of the scratch) and
        compressor / indexer tails."""
        size = dtype_bytes(dtype)
        rates = config.compress_rates
        tails = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 1}  # x rate (overlap: 2)
        block = min(
            [config.sliding_window]
            + [n * rates[kind] for kind, n in tails.items() if kind in config.layer_types]
        )
        total = 0
        for kind in config.layer_types:
            total += (config.sliding_window + block) * config.head_dim
            if kind == "compressed_sparse_attention":  # overlap: 2 * rate tokens of 2x-wide kv and gate
                total += 2 * (2 * rates[kind]) * 2 * (config.head_dim + config.index_head_dim)
            elif kind == "heavily_compressed_attention":
                total += 2 * rates[kind] * config.head_dim
        return total * size

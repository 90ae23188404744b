"""DeepSeek-V4's per-request attention state, by layer (what replaces the paged token KV pool).

- every layer: a ring of the last `sliding_window` roped K=V rows (position p at p % window);
- CSA / HCA layers: the compressed entries emitted so far (one per `rate` tokens) and the compressor's
  tail, the raw (kv, gate) projections of the tokens it still needs (`Compressor.tail_len`, by
  position modulo that length);
- CSA layers: the same for the Lightning Indexer (its keys and its tail).

A request's state lives in its req_to_token row's slot; it is reset when a row starts at prefix 0 and
freed when the scheduler releases the row.
Entries are stored densely per row up to `max_positions // rate` (not yet paged; see the V4 issue)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.layers.compressor import Compressor


@dataclass
class CompressorState:
    entries: torch.Tensor  # [max_entries, dim]
    tail_kv: torch.Tensor  # [tail_len, width] raw projections, by position % tail_len
    tail_gate: torch.Tensor


@dataclass
class LayerState:
    window: torch.Tensor  # [sliding_window, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class V4StateCache:
    def __init__(self, model, max_positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.model, self.max_positions, self.dtype, self.device = model, max_positions, dtype, device
        self.rows: dict[int, list[LayerState]] = {}

    def _compressor_state(self, comp: Compressor) -> CompressorState:
        width = comp.kv_proj.out_features
        entries = torch.zeros(
            self.max_positions // comp.rate + 1, comp.dim, dtype=self.dtype, device=self.device
        )
        tail = torch.zeros(comp.tail_len, width, dtype=self.dtype, device=self.device)
        return CompressorState(entries, tail, tail.clone())

    def reset(self, row: int) -> None:
        """Fresh state for the request that starts in `row`."""
        cfg = self.model.config
        layers = []
        for attn in self.model.attention_layers():
            window = torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=self.dtype, device=self.device)
            state = LayerState(window)
            if attn.compressor is not None:
                state.compressor = self._compressor_state(attn.compressor)
                if attn.compressor.indexer is not None:
                    state.indexer = self._compressor_state(attn.compressor.indexer)
            layers.append(state)
        self.rows[row] = layers

    def release(self, row: int) -> None:
        """The request in `row` left: free its state (the next request there starts with `reset`)."""
        self.rows.pop(row, None)

    def layer(self, row: int, layer: int) -> LayerState:
        if row not in self.rows:
            raise NotImplementedError(
                f"row {row} continues a request whose V4 state is not here (prefix-cache hits need SWA replay)"
            )
        return self.rows[row][layer]

    @staticmethod
    def bytes_per_token(config, dtype: torch.dtype) -> int:
        """Amortised per-token state: compressed entries (+ indexer keys); the window is per request."""
        size = torch.empty((), dtype=dtype).element_size()
        rates = config.compress_rates
        total = 0
        for kind in config.layer_types:
            if kind == "compressed_sparse_attention":
                total += (config.head_dim + config.index_head_dim) / rates[kind]
            elif kind == "heavily_compressed_attention":
                total += config.head_dim / rates[kind]
        return max(1, int(total * size))

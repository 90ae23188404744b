"""DeepSeek-V4 attention in plain PyTorch over the paged pools and per-row state (`kv_pool.py`).

Per request and layer, each query t attends one shared K=V head over
- the sliding window: keys at positions (t - window, t], from the row's ring plus this step's rows;
- CSA / HCA layers: the compressed entries w < (t + 1) // rate (emitted so far, including the windows
  this step closes), read in place from the pool through req_to_token, and for CSA only the Lightning
  Indexer's top-k of those;
plus a per-head sink logit that takes probability mass but has no value. Requests are attended one by
one here (prefill, chunked prefill, replay); steps whose rows all add the same few tokens (decode, and
verify steps of equal drafts) go to attention_decode.py, every row at once, the same math. A request's
queries go `query_tile` at a time: the indexer's top-k in tiles of entries with a running top-k
(`Indexer.select`, the `index_scores` op), then one `sparse_attention` call over index lists of width
window + top-k (CSA) or + the entries the tile sees (HCA), so memory is bounded by the tiles and
tokens x top-k, never tokens x keys: 64K new tokens on a 128K context fit.

Replay (prefix-cache hits): a row may start at position H - R with `replay` = R leading tokens whose
windows are already in the pools (a cached prefix ending at H). Those tokens run through every layer to
rebuild the row's ring and compressor tails, and read cached entries, but never write an entry: the
pools' entries below H are shared with other requests. Their window attention reads nothing below
H - R (the row's state starts there), which is why bounded replay is close to, not equal to, a cold run."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.sparse_attention import SPARSE_ATTENTION
from runtime.gpu.models.deepseek_v4 import attention_decode
from runtime.gpu.models.deepseek_v4.compressor import Compressor
from runtime.gpu.models.deepseek_v4.kv_pool import RowState, Tail, V4KVPool, V4Layer
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope

GRAPH_CONTEXT_START = 16384  # the smallest context bucket of V4's decode graphs (`graph_contexts`)


@dataclass
class _Row:
    row: int
    start: int  # first token of the row in the step
    length: int
    prefix: int  # position of that token
    cached: int  # windows ending at or before this position are in the pools already (prefix + replay)
    positions: torch.Tensor  # [length] on the device
    table: torch.Tensor  # req_to_token[row]: the row's token slots
    state: RowState


def compress_step(
    comp: Compressor, pool: torch.Tensor, tail: Tail, r: _Row, x: torch.Tensor, rope: InterleavedRope
) -> torch.Tensor:
    """Feed one request's new tokens x [L, D] to a compressor: pool the windows they close (those past
    `r.cached`) into `pool` at their first token's slot // rate, keep the tail; return where the
    request's entries so far are: their rows of `pool` [N] (entry w at `req_to_token[row, w * rate] // rate`).

    Memory is linear in L with no tokens x keys term: at 64K new tokens (bfloat16) CSA's compressor
    (width 2 x 512) peaks near 1.7 GB: the projections and their raw copy (4 x 134 MB), then in `pool`
    the float32 gates, the windows' slots [L / 4, 8, 512] (kv 134 MB, float32 gates 268 MB) and the
    float32 softmax; HCA's near 0.7 GB, the indexer's (dim 128) near 0.45 GB. All freed on return."""
    m, span, length, prefix = comp.rate, comp.tail_len, x.shape[0], r.prefix
    kv, gate = comp.project(x)
    w0, w1 = max(prefix, r.cached) // m, (prefix + length) // m
    if w1 > w0:
        back = 1 if comp.overlap and w0 > 0 else 0  # the closed window whose Ca half entry w0 needs
        first = (w0 - back) * m  # raw positions [first, w1 * m) make the new entries
        if first < r.state.start:
            raise RuntimeError(
                f"row {r.row}: compressor needs position {first}, state starts at {r.state.start}"
            )
        old = torch.arange(min(first, prefix), prefix, device=x.device) % span  # none if all in this step
        new = slice(max(0, first - prefix), w1 * m - prefix)
        raw_kv = torch.cat([tail.kv.index_select(0, old), kv[new]])
        raw_gate = torch.cat([tail.gate.index_select(0, old), gate[new]])
        pool[r.table[w0 * m : w1 * m : m] // m] = comp.pool(raw_kv, raw_gate, w0 - back, rope)[back:]
    keep = min(length, span)
    slots = torch.arange(prefix + length - keep, prefix + length, device=x.device) % span
    tail.kv[slots] = kv[length - keep :]
    tail.gate[slots] = gate[length - keep :]
    return r.table[: w1 * m : m] // m


@dataclass
class _Meta:
    rows: list[_Row]  # the rows with new tokens (none for a batched step)
    decode: attention_decode.DecodeMeta | None  # a decode or verify step, for the batched path


class TorchV4Backend(AttentionBackend):
    def __init__(self, num_heads: int, head_dim: int, sliding_window: int) -> None:
        super().__init__(num_heads, 1, head_dim, head_dim**-0.5)
        self.window = sliding_window
        # decode and verify steps through attention_decode.py, every row at once; False sends them request
        # by request (the same math in another order: the tests' oracle for the batched path)
        self.batched_decode = True
        # the request path's tiles: queries per sparse_attention call (and per indexer top-k), and
        # indexer entries scored at a time: a [query_tile, entry_tile] float32 score tile (256 MB) is
        # the largest tensor the tiling makes. Tests shrink them to exercise the tiling.
        self.query_tile, self.entry_tile = 4096, 16384

    supports_cuda_graph = True
    supports_verify_graph = True

    def prepare_decode_graph(
        self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int, q_len: int = 1
    ) -> None:
        """The batched path from device tensors alone (attention_decode.py), q_len places per row."""
        meta = attention_decode.prepare(batch, batch.kv_pool, self.window, q_len, max_seq_len)
        batch.attn_meta = _Meta([], meta)

    def graph_contexts(self, max_model_len: int) -> list[int]:
        """Compressed-entry widths are fixed per graph (max_seq_len / rate, every entry scored or
        attended, masked past a row's length), so a graph's work grows with its context: 16K, 64K, 256K
        ... below max_model_len, then max_model_len (just that at the default 8K)."""
        out, c = [], GRAPH_CONTEXT_START
        while c < max_model_len:
            out.append(c)
            c *= 4
        return [*out, max_model_len]

    def prepare(self, batch: ForwardBatch) -> None:
        rows, start, cache = [], 0, batch.kv_pool
        q_len = attention_decode.batched_len(batch, cache.max_verify_block) if self.batched_decode else 0
        batched = q_len > 0
        replay = batch.replay_lens or [0] * len(batch.rows_list)
        for row, prefix, length, rp in zip(
            batch.rows_list, batch.prefix_lens, batch.extend_lens, replay, strict=True
        ):
            if length:
                if prefix == 0 or rp:  # a request starts here, or rebuilds its state before a cached prefix
                    cache.reset_row(row, prefix)
                state = cache.row(row)  # raises for a row whose state is not here
                if not batched:  # (the batched path reads the pooled state through its DecodeMeta)
                    positions = batch.positions[start : start + length]
                    table = batch.req_to_token[row]
                    rows.append(_Row(row, start, length, prefix, prefix + rp, positions, table, state))
            start += length
        decode = attention_decode.prepare(batch, cache, self.window, q_len) if batched else None
        batch.attn_meta = _Meta(rows, decode)

    def narrow(self, batch: ForwardBatch, keep: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
        """The step cut to each row's last `keep[i]` tokens, for sliding-only layers that run on those
        alone (decoder bounded replay, model.py). A cut row's window attention reads nothing
        below its first kept token: its state view starts there, over the same ring, so the kept tokens'
        keys land where later steps read them. Returns the cut batch and the kept tokens' step indices.
        Not for layers with a compressor (a cut would skip the windows it must pool)."""
        meta, rows, idx, start, out = iter(batch.attn_meta.rows), [], [], 0, 0
        for length, k in zip(batch.extend_lens, keep, strict=True):
            if length:
                r, cut = next(meta), length - k
                state = replace(r.state, start=r.prefix + cut) if cut else r.state
                positions = r.positions[cut:]
                rows.append(
                    replace(r, start=out, length=k, prefix=r.prefix + cut, positions=positions, state=state)
                )
                idx.extend(range(start + cut, start + length))
                out += k
            start += length
        idx_t = torch.tensor(idx, dtype=torch.int64, device=batch.input_ids.device)
        cuts = [n - k for n, k in zip(batch.extend_lens, keep, strict=True)]
        replay = (
            [max(0, rp - c) for rp, c in zip(batch.replay_lens, cuts, strict=True)]
            if batch.replay_lens
            else []
        )
        cut_batch = replace(
            batch,
            input_ids=batch.input_ids[idx_t],
            positions=batch.positions[idx_t],
            out_loc=batch.out_loc[idx_t],
            token_rows=batch.token_rows[idx_t],
            prefix_lens=[p + c for p, c in zip(batch.prefix_lens, cuts, strict=True)],
            extend_lens=list(keep),
            replay_lens=replay,
            attn_meta=_Meta(rows, None),
        )
        return cut_batch, idx_t

    def forward_v4(
        self,
        attn: V4Layer,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, H, d], kv [T, d] (roped) of the step's tokens; x [T, D] the layer input and qr [T, q_lora]
        the normed q latent (for the compressors and the indexer). Returns [T, H, d]."""
        if batch.attn_meta.decode is not None:
            return attention_decode.forward(attn, q, kv, x, qr, batch, batch.attn_meta.decode, self.scale)
        out = torch.empty_like(q)
        for r in batch.attn_meta.rows:
            self._attend_row(attn, r, q, kv, x, qr, batch.kv_pool, out)
        return out

    def _attend_row(
        self,
        attn: V4Layer,
        r: _Row,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        cache: V4KVPool,
        out: torch.Tensor,
    ) -> None:
        """One request's new tokens into `out`, `query_tile` queries a call of the sparse_attention op:
        its first source the window's keys (the ring's, then this step's), its second the layer's entry
        pool through each query's list (CSA: the indexer's top-k; HCA: every entry, one list shared by
        the tile and cut per query by `extra_topk_length`). No tensor spans tokens x keys."""
        w, lid, s, e, p = self.window, attn.layer_id, r.start, r.start + r.length, r.prefix
        layer, device = r.state.layers[lid], q.device
        lo = max(r.state.start, p - w + 1)
        keys = torch.cat([layer.window.index_select(0, torch.arange(lo, p, device=device) % w), kv[s:e]])
        comp, rows, index_keys = attn.compressor, None, None  # keys[i]: position lo + i
        if comp is not None:
            rows = compress_step(comp, cache.entries[lid], layer.compressor, r, x[s:e], attn.rope)
            if comp.indexer is not None:
                pool = cache.index_keys[lid]
                index_keys = pool[compress_step(comp.indexer, pool, layer.indexer, r, x[s:e], attn.rope)]
        attend = SPARSE_ATTENTION.get(device)
        # window row j of the query at position t: position t - w + 1 + j, row t - w + 1 + j - lo of keys
        back = torch.arange(w, device=device) - (w - 1)
        for t0 in range(0, r.length, self.query_tile):
            t1 = min(r.length, t0 + self.query_tile)
            a, b, pos = s + t0, s + t1, r.positions[t0:t1]
            window = pos[:, None] + back - lo
            window = torch.where(window >= 0, window, -1).int()  # nothing below the state's start
            extra = {}
            seen = 0 if comp is None else (p + t1) // comp.rate  # entries the tile's last query sees
            if seen:
                if index_keys is not None:
                    top = comp.indexer.select(
                        x[a:b], qr[a:b], pos, index_keys[:seen], attn.rope, self.entry_tile
                    )
                    extra["extra_indices"] = torch.where(top >= 0, rows[top.clamp(min=0)], -1).int()
                else:
                    extra["extra_indices"] = rows[:seen].int().expand(t1 - t0, -1)
                    extra["extra_topk_length"] = ((pos + 1) // comp.rate).int()
                extra["extra_kv"] = cache.entries[lid]
            attend(q[a:b], keys, window, attn.sinks, self.scale, out=out[a:b], **extra)
        keep = min(r.length, w)
        layer.window[torch.arange(p + r.length - keep, p + r.length, device=device) % w] = kv[e - keep : e]

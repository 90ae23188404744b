"""DeepSeek-V4 attention for a decode step, every row at once (no Python loop over requests).

`attention.py` attends request by request (any step: prefill, chunked prefill, replay). A decode step, one
new token per row, has the same shape for every row, so here each layer runs a fixed number of batched
ops whatever the batch size, and no op's shape depends on a row's length except through the entries'
padded width (the step's largest; under a CUDA graph, max_model_len / rate). Padding rows of a graph
batch (row 0, position 0) write only row 0's slices and page 0, and their outputs are dropped:

- the sliding window is read in place from the pooled rings (`V4KVPool.rings`, [rows, window, d]):
  the token is written at its ring slot first, then each row attends every slot of its ring whose
  position (the latest one congruent to the slot, p - ((p - j) mod window)) is at or past the row's
  state start;
- a compressor pushes every row's token into its tail and pools the window the token closes for every
  row, written only where (p + 1) % rate == 0 (rows whose window stays open write their entry's old
  value back, so no host branch);
- the compressed entries are read in place from the paged pool through req_to_token (entry w of a row
  at `req_to_token[row, w * rate] // rate`), CSA's narrowed to the Lightning Indexer's top-k (a list of
  top-k indices, so the attention's width is top-k however many entries a row has);
- one `sparse_attention` call takes the rings as its first source and the entry pool as its second.

The math is attention.py's; only the order of the keys in the softmax sums differs (tests/unit/gpu/
test_deepseek_v4_decode.py compares the two paths' logits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.sparse_attention import SPARSE_ATTENTION
from runtime.gpu.models.deepseek_v4.compressor import Compressor, Indexer
from runtime.gpu.models.deepseek_v4.kv_pool import Tail, V4KVPool, V4Layer
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope


@dataclass
class DecodeMeta:
    """What every layer of one decode step shares."""

    rows: torch.Tensor  # [B] req_to_token rows (also the state rows)
    positions: torch.Tensor  # [B] each row's new token's position
    ring_index: torch.Tensor  # [B, window] int32: flat ring row (row * window + slot) or -1 (not visible)
    entries: dict[int, torch.Tensor]  # rate -> [B, W] int32 entry-pool index of window w, -1 past the row's


def is_decode(batch: ForwardBatch) -> bool:
    """One new token per row and no replay: the step `forward` serves."""
    return bool(batch.extend_lens) and all(n == 1 for n in batch.extend_lens) and not any(batch.replay_lens)


def prepare(batch: ForwardBatch, cache: V4KVPool, window: int, max_seq_len: int | None = None) -> DecodeMeta:
    """Once per step: the ring slots each row sees and, per compression rate, its entries' pool indices.
    Entry widths: the step's largest (from the host's prefix lengths), or with `max_seq_len` the most
    any row can have, for a CUDA graph (device tensors only, fixed shapes)."""
    device = batch.positions.device
    rows, pos = batch.rows.long(), batch.positions.long()
    starts = cache.starts[rows]
    slot = torch.arange(window, device=device)
    key_pos = pos[:, None] - torch.remainder(pos[:, None] - slot, window)
    ring_index = torch.where(key_pos >= starts[:, None], rows[:, None] * window + slot, -1).int()
    entries = {}
    for rate in cache.rates:
        if max_seq_len is None:
            width = max((p + 1) // rate for p in batch.prefix_lens)
        else:
            width = max_seq_len // rate
        w = torch.arange(width, device=device)
        index = batch.req_to_token[rows[:, None], w * rate] // rate
        entries[rate] = torch.where(w[None, :] < ((pos + 1) // rate)[:, None], index, -1).int()
    return DecodeMeta(rows, pos, ring_index, entries)


def forward(
    attn: V4Layer,
    q: torch.Tensor,
    kv: torch.Tensor,
    x: torch.Tensor,
    qr: torch.Tensor,
    batch: ForwardBatch,
    meta: DecodeMeta,
    scale: float,
) -> torch.Tensor:
    """q [B, H, d], kv [B, d] (roped), x [B, D] the layer input, qr [B, q_lora] the normed q latent.
    Returns [B, H, d]."""
    cache, lid = batch.kv_pool, attn.layer_id
    ring = cache.rings[lid]
    window = ring.shape[1]
    ring[meta.rows, meta.positions % window] = kv
    extra = {}
    comp = attn.compressor
    if comp is not None:
        table = batch.req_to_token
        push_and_pool(comp, cache.entries[lid], cache.tails[lid], x, meta, table, attn.rope)
        index = meta.entries[comp.rate]
        if comp.indexer is not None:
            push_and_pool(
                comp.indexer, cache.index_keys[lid], cache.index_tails[lid], x, meta, table, attn.rope
            )
            index = select(comp.indexer, x, qr, meta.positions, cache.index_keys[lid], index, attn.rope)
        if index.shape[1]:
            extra = {"extra_kv": cache.entries[lid], "extra_indices": index}
    attend = SPARSE_ATTENTION.get(q.device)
    return attend(q, ring.view(-1, ring.shape[-1]), meta.ring_index, attn.sinks, scale, **extra)


def push_and_pool(
    comp: Compressor,
    pool: torch.Tensor,
    tail: Tail,
    x: torch.Tensor,
    meta: DecodeMeta,
    table: torch.Tensor,
    rope: InterleavedRope,
) -> None:
    """Every row's token into its tail; the window it closes pooled into `pool` (attention.compress_step
    for one token per row). Rows whose window stays open rewrite an entry of theirs with its own value:
    no other row writes that entry this step (an entry is written only by the step that closes its
    window; padding rows, row 0, use page 0, which is never handed out)."""
    m, span = comp.rate, comp.tail_len
    rows, pos = meta.rows, meta.positions
    kv, gate = comp.project(x)
    tail.kv[rows, pos % span] = kv
    tail.gate[rows, pos % span] = gate
    raw = (pos[:, None] + 1 - span + torch.arange(span, device=pos.device)) % span  # the last span tokens
    window = (pos + 1) // m - 1  # the window this token closes, if it does
    entry = pool_window(comp, tail.kv[rows[:, None], raw], tail.gate[rows[:, None], raw], window, rope)
    dst = table[rows, window.clamp(min=0) * m] // m
    closes = ((pos + 1) % m == 0)[:, None]
    pool[dst] = torch.where(closes, entry, pool[dst])


def pool_window(
    comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, window: torch.Tensor, rope: InterleavedRope
) -> torch.Tensor:
    """Raw kv / gate [B, tail_len, width] of each row's last tail_len tokens -> the entry [B, dim] of the
    window they end, by `Compressor.pool`. With overlap the tail is the window before and this one (the
    first entry, that window's, is dropped); window 0 has no window before it, so its gate is -inf."""
    if comp.overlap:
        gate = gate.clone()
        gate[:, : comp.rate].masked_fill_((window < 1)[:, None, None], float("-inf"))
    windows = kv.shape[1] // comp.rate
    return comp.pool(kv, gate, window - (windows - 1), rope)[:, -1]


def select(
    indexer: Indexer,
    x: torch.Tensor,
    qr: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    index: torch.Tensor,
    rope: InterleavedRope,
) -> torch.Tensor:
    """`Indexer.select` for one query per row over its entries `index` [B, W] (-1: none) of the key pool
    `keys` -> the top-k each row attends, as entry indices [B, min(top-k, W)] (-1: none; the attention
    then walks top-k columns, not W)."""
    k = keys[index.clamp(min=0).long()].float()  # [B, W, c]
    scores = indexer.scores(x, qr, positions, rope, lambda q: torch.einsum("bhc,bwc->bhw", q, k))
    valid = index >= 0
    scores = scores.masked_fill(~valid, float("-inf"))
    picked = scores.topk(min(indexer.topk, index.shape[1]), dim=-1).indices
    return torch.where(valid.gather(1, picked), index.gather(1, picked), -1)

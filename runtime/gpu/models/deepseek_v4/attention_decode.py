"""DeepSeek-V4 attention for decode and verify steps, every row at once (no Python loop over requests).

`attention.py` attends request by request (any step: prefill, chunked prefill, replay). A decode step (one
new token per row) or a verify step (a row's last token and its k drafts: q_len = k + 1 consecutive
positions, every row the same q_len) has the same shape for every row, so here each layer runs a fixed
number of batched ops whatever the batch size, and no op's shape depends on a row's length except
through the entries' padded width (the step's largest; under a CUDA graph, max_model_len / rate).

The step's T tokens are B groups of q_len places (group b's at b * q_len ..), each place its own (row,
position) (`ForwardBatch.token_rows`). A place attends its own row's places up to itself: those of its
group with the same row at consecutive positions before it (its run; a CUDA graph's padding places, row
0 at position 0, are runs of one whose outputs are dropped; they write only row 0's slices and page 0):

- the sliding window: the step's new keys wait in a scratch behind the pooled rings
  (`V4KVPool.window_keys`) while the places attend, so a place reads its window's older positions from
  the ring as it was before the step (the latest position congruent to the slot below the run's first,
  at or past the row's state start) and its run's keys up to itself from the scratch; the keys go into
  the rings afterwards. (Written first, a later place's key would overwrite a slot an earlier place
  still reads once q_len > 1.)
- a compressor reads each place's last `tail_len` raw tokens from its tail (positions before the run's
  first) and from this step's projections (the rest), pools the window each place closes, writes it
  where (p + 1) % rate == 0 (places whose window stays open write the padding page's entry 0 with its
  own value: no host branch; a run closes 0, 1 or 2 windows of rate 4, each pooled at its position),
  and then pushes the step's tokens into the tail;
- the compressed entries are read in place from the paged pool through req_to_token (entry w of a row
  at `req_to_token[row, w * rate] // rate`), each place's those w < (p + 1) // rate; CSA's narrowed to the
  Lightning Indexer's top-k (its keys gathered once per group, scored per place);
- one `sparse_attention` call takes the window keys as its first source and the entry pool as its second.

Rejected drafts: the model runner saves the ring and tail entries a verify block overwrites before the
step and restores the rejected ones after it (`V4KVPool.save_blocks` / `restore_rejected`); an entry a
rejected token pooled is written again, when its window closes again, before any query can see it.

The math is attention.py's; only the order of the keys in the softmax sums differs (tests/unit/gpu/
test_deepseek_v4_decode.py compares the two paths' logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.sparse_attention import SPARSE_ATTENTION
from runtime.gpu.models.deepseek_v4.compressor import Compressor, Indexer
from runtime.gpu.models.deepseek_v4.kv_pool import Tail, V4KVPool, V4Layer
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope


@dataclass
class DecodeMeta:
    """What every layer of one step shares (T places: B groups of q_len)."""

    q_len: int
    rows: torch.Tensor  # [T] each place's state row
    positions: torch.Tensor  # [T]
    first: torch.Tensor  # [T] the position of the first place of its run (its row's first this step)
    window_index: torch.Tensor  # [T, window + q_len] int32 rows of `window_keys` (ring, scratch) or -1
    groups: dict[int, torch.Tensor]  # rate -> [B, W] entry-pool index of window w of group b's row
    entries: dict[int, torch.Tensor]  # rate -> [T, W] int32: groups' row for each place, -1 past its own
    raw: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # `raw_tokens` by tail length


def batched_len(batch: ForwardBatch, max_len: int) -> int:
    """The new tokens every row has when the step can take the batched path (the same number per row, at
    most `max_len`, the scratch's share of a row; no replay), else 0."""
    lens = set(batch.extend_lens)
    if len(lens) != 1 or any(batch.replay_lens):
        return 0
    n = lens.pop()
    return n if 0 < n <= max_len else 0


def prepare(
    batch: ForwardBatch, cache: V4KVPool, window: int, q_len: int = 1, max_seq_len: int | None = None
) -> DecodeMeta:
    """Once per step: each place's run, the window slots and scratch rows it sees and, per compression
    rate, its entries' pool indices. Entry widths: the step's largest (from the host's lengths), or with
    `max_seq_len` the most any row can have, for a CUDA graph (device tensors only, fixed shapes)."""
    device = batch.positions.device
    rows, pos = batch.token_rows.long(), batch.positions.long()
    t = rows.shape[0]
    grid_rows, grid_pos = rows.view(-1, q_len), pos.view(-1, q_len)
    place = torch.arange(q_len, device=device)
    lag = place[:, None] - place[None, :]  # [j, i]: how many places i comes before j
    # [B, j, i]: place i is in place j's run (same row, `lag` positions earlier)
    run = (
        (lag >= 0)
        & (grid_rows[:, :, None] == grid_rows[:, None, :])
        & (grid_pos[:, None, :] == grid_pos[:, :, None] - lag)
    )
    first = pos - torch.where(run, lag, -1).amax(-1).flatten()
    # the ring as it was before the step: slot j holds the latest position congruent to j below `first`
    slot = torch.arange(window, device=device)
    key_pos = (first - 1)[:, None] - torch.remainder((first - 1)[:, None] - slot, window)
    lowest = torch.maximum(cache.starts[rows], pos - window + 1)
    ring = torch.where(key_pos >= lowest[:, None], rows[:, None] * window + slot, -1)
    scratch = cache.scratch_start + torch.arange(t, device=device).view(-1, 1, q_len)
    new = torch.where(run, scratch, -1).view(t, q_len)
    window_index = torch.cat([ring, new], 1).int()
    group_rows = grid_rows[:, 0]
    own = (grid_rows == group_rows[:, None]).flatten()
    groups, entries = {}, {}
    for rate in cache.rates:
        if max_seq_len is None:
            width = max((p + n) // rate for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True))
        else:
            width = max_seq_len // rate
        w = torch.arange(width, device=device)
        index = batch.req_to_token[group_rows[:, None], w * rate] // rate
        visible = (w[None, :] < ((pos + 1) // rate)[:, None]) & own[:, None]
        groups[rate] = index
        entries[rate] = torch.where(visible, index.repeat_interleave(q_len, 0), -1).int()
    return DecodeMeta(q_len, rows, pos, first, window_index, groups, entries)


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
    """q [T, H, d], kv [T, d] (roped), x [T, D] the layer input, qr [T, q_lora] the normed q latent.
    Returns [T, H, d]."""
    cache, lid = batch.kv_pool, attn.layer_id
    keys, ring = cache.window_keys[lid], cache.rings[lid]
    keys[cache.scratch_start : cache.scratch_start + kv.shape[0]] = kv
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
            index = select(comp.indexer, x, qr, meta, cache.index_keys[lid], comp.rate, attn.rope)
        if index.shape[1]:
            extra = {"extra_kv": cache.entries[lid], "extra_indices": index}
    out = SPARSE_ATTENTION.get(q.device)(q, keys, meta.window_index, attn.sinks, scale, **extra)
    ring[meta.rows, meta.positions % ring.shape[1]] = kv  # after the places read the ring's old slots
    return out


def raw_tokens(meta: DecodeMeta, span: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each place's last `span` raw tokens are ([T, span] each): their tail slots (positions
    modulo span), and for those at or past the run's first, True and their place in the step."""
    if span not in meta.raw:
        pos = meta.positions
        back = torch.arange(span - 1, -1, -1, device=pos.device)  # how far before the place
        raw = pos[:, None] - back
        place = torch.arange(pos.shape[0], device=pos.device)[:, None] - back
        meta.raw[span] = (raw % span, raw >= meta.first[:, None], place.clamp(min=0))
    return meta.raw[span]


def push_and_pool(
    comp: Compressor,
    pool: torch.Tensor,
    tail: Tail,
    x: torch.Tensor,
    meta: DecodeMeta,
    table: torch.Tensor,
    rope: InterleavedRope,
) -> None:
    """The window each place closes pooled into `pool`, then every place's token into its tail
    (attention.compress_step for a run of places per row). Places whose window stays open rewrite entry 0,
    of the padding page (never handed out), with its own value: no real row's entry is touched twice."""
    m, span = comp.rate, comp.tail_len
    rows, pos = meta.rows, meta.positions
    kv, gate = comp.project(x)
    slots, new, place = raw_tokens(meta, span)
    rows_2d = rows[:, None]
    raw_kv = torch.where(new[..., None], kv[place], tail.kv[rows_2d, slots])
    raw_gate = torch.where(new[..., None], gate[place], tail.gate[rows_2d, slots])
    window = (pos + 1) // m - 1  # the window this place closes, if it does
    entry = pool_window(comp, raw_kv, raw_gate, window, rope)
    closes = (pos + 1) % m == 0
    dst = torch.where(closes, table[rows, window.clamp(min=0) * m] // m, 0)
    pool[dst] = torch.where(closes[:, None], entry, pool[dst])
    tail.kv[rows, pos % span] = kv
    tail.gate[rows, pos % span] = gate


def pool_window(
    comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, window: torch.Tensor, rope: InterleavedRope
) -> torch.Tensor:
    """Raw kv / gate [T, tail_len, width] of each place's last tail_len tokens -> the entry [T, dim] of the
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
    meta: DecodeMeta,
    keys: torch.Tensor,
    rate: int,
    rope: InterleavedRope,
) -> torch.Tensor:
    """`Indexer.select` for every place over its entries (`meta.entries[rate]`, -1: none) of the key pool
    `keys` -> the top-k each place attends, as entry indices [T, min(top-k, W)] (-1: none; the attention
    then walks top-k columns, not W). A group's keys are gathered once for its places."""
    k = keys[meta.groups[rate]].float()  # [B, W, c]
    q_len, index = meta.q_len, meta.entries[rate]

    def dot(q: torch.Tensor) -> torch.Tensor:  # [T, heads, c] -> [T, heads, W]
        t, heads, c = q.shape
        return torch.einsum("bjhc,bwc->bjhw", q.view(-1, q_len, heads, c), k).reshape(t, heads, -1)

    scores = indexer.scores(x, qr, meta.positions, rope, dot)
    valid = index >= 0
    scores = scores.masked_fill(~valid, float("-inf"))
    picked = scores.topk(min(indexer.topk, index.shape[1]), dim=-1).indices
    return torch.where(valid.gather(1, picked), index.gather(1, picked), -1)

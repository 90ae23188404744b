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

- the sliding window is read in place from the pooled rings (`V4KVPool.rings`): every place's key is
  written at its ring slot first, then each place attends every slot whose position (the latest one
  congruent to the slot up to its run's last place) is at or past the row's state start and at most its
  own; a slot a later place of its run overwrote still holds, for this place, the key that slot held
  before the step, which the step first copied to the scratch behind the rings (`window_keys`; q_len > 1
  only: one token per row overwrites only a position out of its window);
- a compressor pools the windows each row's run closes (0, 1 or 2 of rate 4 for q_len <= 8: the
  positions p of the run with (p + 1) % rate == 0, each at its own window), reading their raw tokens from
  the row's tail (positions before the run) and from this step's projections (the rest), and writes each
  closing window's entry (one `pool_closing` launch, which also works out which windows close: no host
  branch); then it pushes every place's token into its tail;
- the compressed entries are read in place from the paged pool through req_to_token (entry w of a row
  at `req_to_token[row, w * rate] // rate`), each place's those w < (p + 1) // rate; CSA's narrowed to the
  Lightning Indexer's top-k (the `row_index_scores` op: each group's keys read in place, scored per place);
- one `sparse_attention` call takes the window keys (rings, scratch) as its first source and the entry
  pool as its second.

Rejected drafts: the model runner saves the ring and tail entries a verify block overwrites before the
step and restores the rejected ones after it (`V4KVPool.save_blocks` / `restore_rejected`); an entry a
rejected token pooled is written again, when its window closes again, before any query can see it.

The math is attention.py's; only the order of the keys in the softmax sums differs (tests/unit/gpu/
test_deepseek_v4_decode.py compares the two paths' logits)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.compress_pool import POOL_CLOSING
from runtime.gpu.kernels.index_scores import ROW_INDEX_SCORES
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
    window_index: torch.Tensor  # [T, window] int32 rows of `window_keys` (ring slot or scratch) or -1
    in_run: torch.Tensor  # [B, q_len] bool: place j continues place 0's run (the group's row's new tokens)
    groups: dict[int, torch.Tensor]  # rate -> [B, W] entry-pool index of window w of group b's row
    entries: dict[int, torch.Tensor]  # rate -> [T, W] int32: groups' row for each place, -1 past its own
    seen: dict[int, torch.Tensor]  # rate -> [T]: the entries each place sees (its row's first ones)
    # positions modulo a ring's or tail's length: each place's slot there, once a step per length
    slots: dict[int, torch.Tensor] = field(default_factory=dict)

    def slot(self, length: int) -> torch.Tensor:
        if length not in self.slots:
            self.slots[length] = self.positions % length
        return self.slots[length]


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
    """Once per step: each place's run, the window keys it sees (each ring slot's row in the ring or in
    the scratch) and, per compression rate, its entries' pool indices. Entry widths: the step's largest
    (from the host's lengths), or with `max_seq_len` the most any row can have, for a CUDA graph (device
    tensors only, fixed shapes)."""
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
    last = pos + torch.where(run.transpose(1, 2), -lag, -1).amax(-1).flatten()  # the run's last place
    # after the step's writes slot j holds the latest position congruent to j up to `last`; one past
    # this place's position was written by a later place of its run, whose scratch row keeps the old key
    slot = torch.arange(window, device=device)
    key_pos = last[:, None] - torch.remainder(last[:, None] - slot, window)
    later = key_pos > pos[:, None]
    lowest = torch.maximum(cache.starts[rows], pos - window + 1)
    ring = rows[:, None] * window + slot
    scratch = cache.scratch_start + torch.arange(t, device=device)[:, None] + key_pos - pos[:, None]
    key_pos = torch.where(later, key_pos - window, key_pos)
    window_index = torch.where(key_pos >= lowest[:, None], torch.where(later, scratch, ring), -1).int()
    group_rows = grid_rows[:, 0]
    in_run = run[:, :, 0].contiguous()  # dense: the pool_closing launches read it
    groups, entries, seen = {}, {}, {}
    for rate in cache.rates:
        if max_seq_len is None:
            width = max((p + n) // rate for p, n in zip(batch.prefix_lens, batch.extend_lens, strict=True))
        else:
            width = max_seq_len // rate
        w = torch.arange(width, device=device)
        index = batch.req_to_token[group_rows[:, None], w * rate] // rate
        seen[rate] = torch.where(in_run.flatten(), (pos + 1) // rate, 0).clamp_(max=width)
        groups[rate] = index
        entries[rate] = torch.where(
            w[None, :] < seen[rate][:, None], index.repeat_interleave(q_len, 0), -1
        ).int()
    return DecodeMeta(q_len, rows, pos, window_index, in_run, groups, entries, seen)


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
    slots = meta.slot(ring.shape[1])
    if meta.q_len > 1:  # what the places overwrite, for the earlier places of their runs
        keys[cache.scratch_start : cache.scratch_start + kv.shape[0]] = ring[meta.rows, slots]
    ring[meta.rows, slots] = kv
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
    return SPARSE_ATTENTION.get(q.device)(q, keys, meta.window_index, attn.sinks, scale, **extra)


def push_and_pool(
    comp: Compressor,
    pool: torch.Tensor,
    tail: Tail,
    x: torch.Tensor,
    meta: DecodeMeta,
    table: torch.Tensor,
    rope: InterleavedRope,
) -> None:
    """The windows each row's run of places closes pooled into `pool` (the `pool_closing` op), then every
    place's token into its tail (attention.compress_step for a run per row)."""
    kv, gate = comp.project(x)
    POOL_CLOSING.get(x.device)(
        kv, gate, tail.kv, tail.gate, meta.rows, meta.positions, meta.in_run, table, pool, comp.position_bias,
        comp.overlap, comp.kv_norm.weight, comp.kv_norm.eps, rope.inv_freq_on(x.device), rope.scaling,
    )  # fmt: skip
    slot = meta.slot(comp.tail_len)
    tail.kv[meta.rows, slot] = kv
    tail.gate[meta.rows, slot] = gate


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
    then walks top-k columns, not W). The `row_index_scores` op reads each group's keys in place through
    its entry table and sums the heads itself: the largest tensor is the scores [T, W] float32."""
    index = meta.entries[rate]
    q, weights = indexer.queries(x, qr, meta.positions, rope)
    scores = ROW_INDEX_SCORES.get(x.device)(
        q.to(keys.dtype), weights, keys, meta.groups[rate], meta.seen[rate]
    )
    best, picked = scores.topk(min(indexer.topk, index.shape[1]), dim=-1)
    return torch.where(best > float("-inf"), index.gather(1, picked), -1)

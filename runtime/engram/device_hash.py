"""Engram addressing on the device: a step's table rows from token ids that are already there.

The host hashing (`hashing.py`) needs a decode row's input token on the host, which the step before
samples on the device; the device hashing reads it where it is (the batch's input ids, fed back from
the `fed` table), so a decode step's lookup needs no host sync and runs inside its CUDA graph. A
token's address needs its N - 1 predecessors too: the step's own tokens, and before a row's first new
token the row's `history`, the compressed ids of its last N - 1 tokens, updated by every step on the
device (and set on the host when a request enters its row, from the ids the scheduler sends).

The arithmetic is the host's: compressed id times the layer's odd multiplier, XORed over the n-gram,
modulo the table's prime, plus the table's offset in the global row space, in int64. The multipliers
are drawn below int64 max / compressed vocabulary (`hashing.layer_multipliers`), so no product wraps
on either side, XOR of non-negative values stays non-negative, and `%` of non-negative values is the
same in numpy and torch: the rows are equal bit for bit (tests/unit/engram/test_device_hash.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.engram.hashing import NgramHasher


class DeviceHasher:
    def __init__(self, hasher: NgramHasher, rows: int, device: torch.device) -> None:
        """`rows`: request rows of the worker's tables (row 0, the padding row, included)."""
        cfg = hasher.cfg
        self.hasher, self.device = hasher, device
        self.n, self.heads = cfg.max_ngram_size, cfg.n_head_per_ngram
        self.lookup = torch.from_numpy(hasher.lookup).to(device)  # tokenizer id -> compressed id
        self.mult = torch.from_numpy(np.stack([hasher.mult[layer] for layer in cfg.layer_ids])).to(device)
        self.prime = torch.from_numpy(hasher.primes).to(device)  # [layers, (N - 1) * heads]
        self.offset = torch.from_numpy(hasher.offsets).to(device)
        # history[row, j]: compressed id of the token N - 1 - j places before the row's next one
        self.history = torch.full((rows, self.n - 1), hasher.pad, dtype=torch.int64, device=device)

    def set_history(self, rows: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Requests entering `rows`: the next token each processes is at `starts[i]` of ids `seqs[i]`."""
        if not rows:
            return
        ctx = self.n - 1
        hist = np.full((len(rows), ctx), self.hasher.pad, dtype=np.int64)
        for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
            before = np.asarray(seq[max(0, start - ctx) : start], dtype=np.int64)
            if len(before):
                hist[i, ctx - len(before) :] = self.hasher.lookup[before]
        packed = torch.from_numpy(np.concatenate([np.asarray(rows, dtype=np.int64), hist.reshape(-1)]))
        packed = packed.to(self.device, non_blocking=True)  # one copy, no host sync
        self.history[packed[: len(rows)]] = packed[len(rows) :].view(len(rows), ctx)

    def addresses(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        owner: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:
        """Global rows [T, columns] of a step's tokens `ids` [T], and each row's history moved past them.

        `rows` [B]: the step's request rows; per token, `offsets` [T] its index among its row's new
        tokens and `owner` [T] its row's index in `rows`; `last` [B]: each row's last token's index."""
        n, t = self.n, ids.shape[0]
        c = self.lookup[ids]
        k = torch.arange(n, device=ids.device)
        back = offsets[:, None] - k  # [T, N]: where the token k places back sits among its row's new ones
        in_step = c[(torch.arange(t, device=ids.device)[:, None] - k).clamp(min=0)]
        hist = self.history[rows][owner[:, None], (n - 1 + back).clamp(0, n - 2)]
        ctx = torch.where(back >= 0, in_step, hist)  # [T, N]: compressed id of the token k places back
        self.history[rows] = ctx[last, : n - 1].flip(-1)
        terms = ctx[:, None, :] * self.mult  # [T, layers, N]
        mix, orders = terms[..., 0], []
        for o in range(1, n):  # order o + 1 XORs terms 0..o
            mix = mix ^ terms[..., o]
            orders.append(mix)
        mix = torch.stack(orders, -1).repeat_interleave(self.heads, dim=-1)  # [T, layers, (N - 1) * heads]
        return (mix % self.prime + self.offset).view(t, -1)

"""Engram addressing: token ids -> table rows, on the host, from token ids alone.

Each Engram layer has one table per (n-gram order n = 2..N, head j), of a distinct prime size. A token's
row in table (n, j) is `mix_n mod prime_{n,j}`, where `mix_n` XORs the layer's odd multipliers times the
compressed ids of the token and its n - 1 predecessors (the compressed `pad_id` before a sequence's
start). The serving layout puts every table of every layer into one global row space (layer by layer,
then order, then head), so an address is a single int64 row and a placement shards rows by range.

`runtime/engram/reference.py` is the independent plain version the tests compare this with."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from runtime.engram.config import EngramConfig

PRIME_STRIDE = 10007  # layer_id's weight in the multiplier seed (the published algorithm's constant)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    f = 5
    while f * f <= n:
        if n % f == 0 or n % (f + 2) == 0:
            return False
        f += 6
    return True


def table_sizes(cfg: EngramConfig) -> dict[int, list[int]]:
    """Per layer, the prime size of each of its tables in (order, head) order: each the next prime above
    the previous one (starting below the order's `engram_vocab_size`), never one used before."""
    seen: set[int] = set()
    sizes: dict[int, list[int]] = {}
    for layer in cfg.layer_ids:
        layer_sizes = []
        for n in range(2, cfg.max_ngram_size + 1):
            p = cfg.engram_vocab_size[n - 2] - 1
            for _ in range(cfg.n_head_per_ngram):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                layer_sizes.append(p)
        sizes[layer] = layer_sizes
    return sizes


def layer_multipliers(cfg: EngramConfig, compressed_vocab: int) -> dict[int, np.ndarray]:
    """Per layer, N odd multipliers small enough that id * multiplier stays inside int64."""
    half = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    out = {}
    for layer in cfg.layer_ids:
        rng = np.random.default_rng(cfg.seed + PRIME_STRIDE * layer)
        out[layer] = rng.integers(0, half, size=cfg.max_ngram_size, dtype=np.int64) * 2 + 1
    return out


class NgramHasher:
    """Addresses of a step's tokens in the global row space.

    `lookup` maps tokenizer ids to compressed ids (`runtime.engram.compression`)."""

    def __init__(self, cfg: EngramConfig, lookup: np.ndarray) -> None:
        self.cfg = cfg
        self.lookup = np.asarray(lookup, dtype=np.int64)
        self.compressed_vocab = len(np.unique(self.lookup))  # the compressed vocabulary's size
        self.pad = int(self.lookup[cfg.pad_id])
        self.sizes = table_sizes(cfg)
        self.mult = layer_multipliers(cfg, self.compressed_vocab)
        heads = cfg.heads_per_layer
        # per layer, [heads] primes and the global row of each table's first row
        self.primes = np.array([self.sizes[layer] for layer in cfg.layer_ids], dtype=np.int64)
        flat = self.primes.reshape(-1)
        self.offsets = (np.cumsum(flat) - flat).reshape(len(cfg.layer_ids), heads)
        self.total_rows = int(flat.sum())
        # per column (layer, order, head): its layer's multiplier of the token itself, prime and offset
        layer_of = np.repeat(np.arange(len(cfg.layer_ids)), heads)
        self._col_m0 = np.array([self.mult[cfg.layer_ids[i]][0] for i in layer_of], dtype=np.int64)
        self._col_prime, self._col_offset = flat, self.offsets.reshape(-1)

    @cached_property
    def columns(self) -> int:
        """Addresses per token: one per table of every Engram layer."""
        return len(self.cfg.layer_ids) * self.cfg.heads_per_layer

    def layer_rows(self, layer: int) -> tuple[int, int]:
        """The global row range of one layer's tables."""
        i = self.cfg.layer_ids.index(layer)
        start = int(self.offsets[i, 0])
        return start, start + int(self.primes[i].sum())

    @property
    def layer_ranges(self) -> dict[int, tuple[int, int]]:
        return {layer: self.layer_rows(layer) for layer in self.cfg.layer_ids}

    def partial(self, seq_ids: Sequence[int] | np.ndarray, pos: int) -> np.ndarray:
        """For the token at `pos` whose own id is not known yet (a decode row's input, sampled by the
        step still running): per column, the XOR of its predecessors' terms [columns]. `complete`
        finishes it once the token is known (XOR is associative)."""
        cfg = self.cfg
        ctx = cfg.max_ngram_size - 1
        prev = self.lookup[np.asarray(seq_ids[max(0, pos - ctx) : pos], dtype=np.int64)]
        prev = np.concatenate([np.full(ctx - len(prev), self.pad, dtype=np.int64), prev])  # prev[-k]: pos - k
        out = np.empty((len(cfg.layer_ids), cfg.heads_per_layer), dtype=np.int64)
        h = cfg.n_head_per_ngram
        for li, layer in enumerate(cfg.layer_ids):
            m, mix = self.mult[layer], np.int64(0)
            for order in range(2, cfg.max_ngram_size + 1):
                mix = mix ^ (prev[-(order - 1)] * m[order - 1])
                out[li, (order - 2) * h : (order - 1) * h] = mix
        return out.reshape(-1)

    def complete(self, partial: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """Global rows [n, columns] of tokens `token_ids` [n] given their `partial` [n, columns]."""
        t0 = self.lookup[np.asarray(token_ids, dtype=np.int64)][:, None]
        return ((t0 * self._col_m0[None]) ^ partial) % self._col_prime[None] + self._col_offset[None]

    def addresses(self, seq_ids: Sequence[int] | np.ndarray, start: int, n: int) -> np.ndarray:
        """Global rows [n, columns] of tokens start .. start + n - 1 of a sequence (only those and the
        N - 1 before them are read)."""
        cfg = self.cfg
        ctx = cfg.max_ngram_size - 1
        lo = max(0, start - ctx)
        ids = self.lookup[np.asarray(seq_ids[lo : start + n], dtype=np.int64)]
        if start - lo < ctx:
            ids = np.concatenate([np.full(ctx - (start - lo), self.pad, dtype=np.int64), ids])
        # shifted[k][t] = compressed id of token start + t - k
        shifted = [ids[ctx - k : ctx - k + n] for k in range(cfg.max_ngram_size)]
        out = np.empty((n, len(cfg.layer_ids), cfg.heads_per_layer), dtype=np.int64)
        h = cfg.n_head_per_ngram
        for li, layer in enumerate(cfg.layer_ids):
            m = self.mult[layer]
            mix = shifted[0] * m[0]
            for order in range(2, cfg.max_ngram_size + 1):
                mix = mix ^ (shifted[order - 1] * m[order - 1])
                cols = slice((order - 2) * h, (order - 1) * h)
                out[:, li, cols] = mix[:, None] % self.primes[li, cols][None, :]
        out += self.offsets[None]
        return out.reshape(n, -1)

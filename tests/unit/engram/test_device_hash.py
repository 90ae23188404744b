"""The device hashing (device_hash.py) gives the host hashing's addresses (hashing.py) bit for bit, for
every layer, order and head, through a request's life: a first chunk from position 0 or after a cached
prefix, further chunks, then decode steps of one token whose predecessors come from the row history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.engram.config import EngramConfig
from runtime.engram.device_hash import DeviceHasher
from runtime.engram.hashing import NgramHasher


def _step_columns(chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, ...]:
    """(row, start, count) per row of a step -> rows, offsets, owner, last as the runtime builds them."""
    counts = [n for _, _, n in chunks]
    offsets = np.concatenate([np.arange(n) for n in counts])
    owner = np.repeat(np.arange(len(chunks)), counts)
    last = np.cumsum(counts) - 1
    return tuple(
        torch.as_tensor(x, dtype=torch.int64) for x in ([r for r, _, _ in chunks], offsets, owner, last)
    )


@pytest.mark.parametrize("n", [2, 3, 4])
def test_device_addresses_equal_host_addresses(n):
    cfg = EngramConfig(
        layer_ids=(0, 3, 9), max_ngram_size=n, n_embed_per_ngram=16, n_head_per_ngram=4,
        engram_vocab_size=tuple(100_000 + 1000 * i for i in range(n - 1)), pad_id=3, seed=n,
    )  # fmt: skip
    rng = np.random.default_rng(n)
    lookup = rng.integers(0, 40_000, size=50_000)  # a compression: ids share compressed ids
    hasher = NgramHasher(cfg, lookup)
    dev = DeviceHasher(hasher, rows=6, device=torch.device("cpu"))
    seqs = {r: rng.integers(0, 50_000, size=40).tolist() for r in (1, 2, 3, 4)}
    # rows 1 and 2 start at 0, row 3 after a cached prefix of 7 tokens, row 4 after one of 1 token
    starts = {1: 0, 2: 0, 3: 7, 4: 1}
    dev.history[:] = 12345  # what earlier requests of these rows left
    dev.set_history(list(starts), [seqs[r] for r in starts], list(starts.values()))
    steps = [
        [(1, 5), (2, 1), (3, 2), (4, 1)],  # chunks, some shorter than the n-gram
        [(1, 1), (2, 1), (3, 6), (4, 9)],
        [(1, 1), (2, 1), (3, 1), (4, 1)],  # decodes
        [(2, 1), (4, 1)],
        [(1, 3), (2, 1), (3, 1), (4, 1)],
        [(1, 1), (2, 1), (3, 1), (4, 1)],
    ]
    pos = dict(starts)
    for step in steps:
        chunks = [(r, pos[r], k) for r, k in step]
        ids = torch.tensor([t for r, s, k in chunks for t in seqs[r][s : s + k]])
        got = dev.addresses(ids, *_step_columns(chunks))
        want = np.concatenate([hasher.addresses(seqs[r], s, k) for r, s, k in chunks])
        np.testing.assert_array_equal(got.numpy(), want)
        for r, k in step:
            pos[r] += k


def test_padding_rows_of_a_graph_step_leave_the_real_rows_alone():
    """A padded decode graph's padding tokens are row 0's: their history writes land in row 0 only."""
    cfg = EngramConfig(
        layer_ids=(1,), n_embed_per_ngram=8, n_head_per_ngram=2, engram_vocab_size=(1009, 1013)
    )
    hasher = NgramHasher(cfg, np.arange(500))
    dev = DeviceHasher(hasher, rows=4, device=torch.device("cpu"))
    seq = list(range(10, 30))
    dev.set_history([2], [seq], [5])
    rows = torch.tensor([2, 0, 0])
    zeros, idx = torch.zeros(3, dtype=torch.int64), torch.arange(3)
    got = dev.addresses(torch.tensor([seq[5], 0, 0]), rows, zeros, idx, idx)
    np.testing.assert_array_equal(got[:1].numpy(), hasher.addresses(seq, 5, 1))
    got = dev.addresses(torch.tensor([seq[6], 0, 0]), rows, zeros, idx, idx)
    np.testing.assert_array_equal(got[:1].numpy(), hasher.addresses(seq, 6, 1))

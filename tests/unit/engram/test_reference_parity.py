"""The serving Engram (hashing.py, layer.py, the device placement) against the reference written from
the published algorithm (reference.py): table sizes of the demo layer, hash indices and layer outputs
on random inputs in float32, the serving side run the way a server runs it (a prefill chunk, then
decode steps through the per-slot convolution cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.engram.config import EngramConfig
from runtime.engram.hashing import NgramHasher, table_sizes
from runtime.engram.layer import EngramLayer
from runtime.engram.placement import DevicePlacement
from runtime.engram.reference import ReferenceEngram, ReferenceHash
from runtime.engram.tables import generate_rows
from runtime.gpu.forward_batch import ForwardBatch

SMALL = EngramConfig(
    layer_ids=(1, 3), n_embed_per_ngram=32, n_head_per_ngram=4, engram_vocab_size=(211, 307), seed=5
)


def test_demo_layer_prime_table_sizes():
    sizes = table_sizes(EngramConfig(layer_ids=(1, 15)))
    two, three = sizes[1][:8], sizes[1][8:]
    assert (two[0], two[-1], three[0], three[-1]) == (646403, 646523, 646537, 646619)
    assert sum(sizes[1]) == 10_344_164
    assert len(set(sizes[1] + sizes[15])) == 32  # distinct across layers, orders and heads
    ref = ReferenceHash(EngramConfig(layer_ids=(1, 15)), np.arange(129280))
    assert [p for order in ref.primes[1] for p in order] == sizes[1]
    assert [p for order in ref.primes[15] for p in order] == sizes[15]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_hash_indices_match_reference(n):
    cfg = EngramConfig(
        layer_ids=(0, 2, 7), max_ngram_size=n, n_embed_per_ngram=16, n_head_per_ngram=4,
        engram_vocab_size=tuple(1000 + 10 * i for i in range(n - 1)), pad_id=3, seed=11,
    )  # fmt: skip
    rng = np.random.default_rng(n)
    lookup = rng.integers(0, 700, size=1000)  # a compression: many ids share one
    lookup[rng.integers(0, 1000, 50)] = 699
    ids = rng.integers(0, 1000, size=(3, 40))
    ref = ReferenceHash(cfg, lookup)(ids)
    hasher = NgramHasher(cfg, lookup)
    for b in range(3):
        for start, count in [(0, 40), (0, 1), (5, 9), (39, 1), (1, 2)]:
            got = hasher.addresses(ids[b], start, count).reshape(count, len(cfg.layer_ids), -1)
            for li, layer in enumerate(cfg.layer_ids):
                want = ref[layer][b, start : start + count] + hasher.offsets[li]
                np.testing.assert_array_equal(got[:, li], want)


class _Slots:  # the KV pool's one property the conv cache reads
    num_slots = 256


def _run_serving(layer, placement, hasher, ids, h, chunks):
    """Run rows of `ids` [B, T] through the serving layer in steps of `chunks` tokens per row."""
    b, t = ids.shape
    req_to_token = torch.zeros(b + 1, t, dtype=torch.int64)
    out = torch.zeros_like(h)
    done = 0
    for n in chunks:
        rows = list(range(1, b + 1))
        pos = torch.arange(done, done + n).repeat(b)
        slots = torch.tensor([r * 64 + p for r in rows for p in range(done, done + n)])
        req_to_token[torch.tensor(rows).repeat_interleave(n), pos] = slots
        batch = ForwardBatch(
            input_ids=torch.from_numpy(ids[:, done : done + n].reshape(-1)), positions=pos, out_loc=slots,
            rows=torch.tensor(rows), rows_list=rows, prefix_lens=[done] * b, extend_lens=[n] * b,
            req_to_token=req_to_token, kv_pool=_Slots(),
        )  # fmt: skip
        addr = np.concatenate([hasher.addresses(ids[i], done, n) for i in range(b)])
        batch.engram = placement.start(addr)
        x = h[:, done : done + n].reshape(b * n, *h.shape[2:])
        out[:, done : done + n] = layer(x, batch).view(b, n, *h.shape[2:])
        done += n
    return out


@pytest.mark.parametrize("hc_mult", [1, 4])
def test_layer_output_matches_reference(hc_mult):
    torch.manual_seed(0)
    cfg, hidden = SMALL, 24
    rng = np.random.default_rng(1)
    lookup = rng.integers(0, 300, size=400)
    hasher, ref_hash = NgramHasher(cfg, lookup), ReferenceHash(cfg, lookup)
    placement = DevicePlacement(cfg, hasher, torch.device("cpu"), torch.float32)
    ids = rng.integers(0, 400, size=(2, 23))
    h = torch.randn(2, 23, hc_mult, hidden)
    for layer_id in cfg.layer_ids:
        ref = ReferenceEngram(cfg, ref_hash, layer_id, hidden, hc_mult)
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 0.3)
            lo, hi = hasher.layer_rows(layer_id)
            ref.embedding.weight.copy_(generate_rows(cfg.seed, lo, hi, cfg.head_dim, torch.float32))
        layer = EngramLayer(cfg, layer_id, hidden, hc_mult)
        state = {k: v for k, v in ref.state_dict().items() if not k.startswith(("embedding", "offsets"))}
        layer.load_state_dict(state)
        with torch.no_grad():
            want = ref(h, ids)
            got = _run_serving(layer, placement, hasher, ids, h, [11, 1, 1, 7, 1, 2])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert want.abs().mean() > 0.05  # a real signal, not zeros on both sides


@pytest.mark.parametrize("n", [2, 3, 4])
def test_partial_hash_completed_with_the_token_equals_the_address(n):
    """What the scheduler sends for a decode row whose input the running step samples, finished by the
    worker with that token, is the token's address."""
    cfg = EngramConfig(layer_ids=(0, 5), max_ngram_size=n, n_embed_per_ngram=16, n_head_per_ngram=4,
                       engram_vocab_size=tuple(1000 + 10 * i for i in range(n - 1)))  # fmt: skip
    rng = np.random.default_rng(n)
    hasher = NgramHasher(cfg, rng.integers(0, 700, size=1000))
    seq = rng.integers(0, 1000, size=30)
    for pos in [0, 1, 2, 3, 17, 29]:
        got = hasher.complete(hasher.partial(seq, pos)[None], seq[pos : pos + 1])
        np.testing.assert_array_equal(got, hasher.addresses(seq, pos, 1))

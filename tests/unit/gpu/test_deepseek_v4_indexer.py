"""The Lightning Indexer's tiled top-k (`Indexer.select`: entries scored a tile at a time by the
`index_scores` op, merged into a running top-k) picks what the dense selection picks (every query's
scores over every entry, masked causally, one top-k: the function it replaced, kept here as the oracle),
for any entry tile and any cut of the queries into tiles, including queries that see fewer entries
than top-k (-1 for the missing ones) or none; and no op call is given more than a tile of entries.
The op's reference equals the dense formula. CPU, float32."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels.index_scores.reference import index_scores
from runtime.gpu.models.deepseek_v4 import compressor as v4_compressor
from runtime.gpu.models.deepseek_v4.compressor import Indexer
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope
from runtime.gpu.testing import tiny_deepseek_v4_config

TOPK, RATE = 5, 4


def dense_select(indexer: Indexer, x, qr, positions, keys, rope) -> torch.Tensor:
    """[L, N] bool: each query's top-k entries among the causal ones, from its scores over all of them."""
    q, weights = indexer.queries(x, qr, positions, rope)
    scores = (torch.einsum("lhc,nc->lhn", q.float(), keys.float()).relu() * weights[..., None]).sum(1)
    causal = torch.arange(keys.shape[0])[None, :] < ((positions + 1) // indexer.rate)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    picked = scores.topk(min(indexer.topk, keys.shape[0]), dim=-1).indices
    return torch.zeros_like(causal).scatter_(1, picked, True) & causal


@pytest.fixture(scope="module")
def indexer():
    config = tiny_deepseek_v4_config(index_topk=TOPK)
    torch.manual_seed(0)
    return Indexer(config).eval(), InterleavedRope(config, "compress"), config


def _inputs(config, prefix: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, config.hidden_size, generator=g)
    qr = torch.randn(length, config.q_lora_rank, generator=g)
    keys = torch.randn((prefix + length) // RATE, config.index_head_dim, generator=g)
    return x, qr, torch.arange(prefix, prefix + length), keys


def _as_mask(picked: torch.Tensor, entries: int) -> torch.Tensor:
    mask = torch.zeros(picked.shape[0], entries + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(picked >= 0, picked, entries), True)  # -1 lands in the spare column
    return mask[:, :entries]


@pytest.mark.parametrize("entry_tile", [1, 3, 7, 1000])
@pytest.mark.parametrize(("prefix", "length"), [(0, 41), (37, 30)])
def test_tiled_top_k_equals_the_dense_selection(indexer, monkeypatch, entry_tile, prefix, length):
    """prefix 0: the first 4 queries see no entry and those before position 4 * TOPK fewer than TOPK."""
    idx, rope, config = indexer
    x, qr, pos, keys = _inputs(config, prefix, length, seed=prefix + entry_tile)
    widths = []
    op = v4_compressor.INDEX_SCORES.get(x.device)

    class Recorder:
        @staticmethod
        def get(device):
            return lambda q, w, k, vis: widths.append(k.shape[0]) or op(q, w, k, vis)

    monkeypatch.setattr(v4_compressor, "INDEX_SCORES", Recorder)
    with torch.no_grad():
        want = dense_select(idx, x, qr, pos, keys, rope)
        for cut in (length, 4):  # the request in one query tile, then in tiles of 4
            got = []
            for t0 in range(0, length, cut):
                t1 = min(length, t0 + cut)
                seen = (prefix + t1) // RATE
                picked = idx.select(x[t0:t1], qr[t0:t1], pos[t0:t1], keys[:seen], rope, entry_tile)
                assert picked.shape[1] == min(TOPK, seen)
                got.append(_as_mask(picked, keys.shape[0]))
            assert torch.equal(torch.cat(got), want)
    assert max(widths) <= entry_tile
    counts = want.sum(1)
    assert counts.max() == TOPK and (prefix > 0 or counts.min() == 0)


def test_reference_op_equals_the_dense_formula():
    g = torch.Generator().manual_seed(1)
    q, w, keys = (
        torch.randn(6, 3, 16, generator=g),
        torch.randn(6, 3, generator=g),
        torch.randn(9, 16, generator=g),
    )
    visible = torch.tensor([0, 1, 4, 9, 9, 20])
    dense = (torch.relu(torch.einsum("thc,nc->thn", q, keys)) * w[..., None]).sum(1)
    dense = dense.masked_fill(torch.arange(9)[None, :] >= visible[:, None], float("-inf"))
    torch.testing.assert_close(index_scores(q, w, keys, visible), dense, atol=1e-5, rtol=0)

"""DeepSeek-V4 prefix hits against cold runs: the harness shared by the prefix tests and
`loadgen.v4_replay`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.testing.plans import PagedPlanBuilder, random_prompt, seq_start


@dataclass
class HitVsCold:
    """One request computed cold and as a prefix hit: logits of the positions past the hit and of the
    greedy decodes, the two greedy continuations, and whether the cached entries stayed untouched."""

    hit: torch.Tensor
    cold: torch.Tensor
    hit_tokens: list[int]
    cold_tokens: list[int]
    cache_untouched: bool
    prompt_rows: int  # the first rows of hit / cold: prompt positions (same inputs in both runs)

    @property
    def max_diff(self) -> float:
        return (self.hit - self.cold).abs().max().item()

    @property
    def prompt_max_diff(self) -> float:
        n = self.prompt_rows
        return (self.hit[:n] - self.cold[:n]).abs().max().item()


def _prefill_and_decode(runner, pb, row, ids, hit, replay, decode, prefix_slots=()):
    """Row `row` computes ids[hit:] after replaying the `replay` tokens before `hit`, in two chunks, then
    decodes greedily; logits of positions hit.. and of the decodes, and the greedy tokens."""
    start, mid = hit - replay, hit + (len(ids) - hit) // 2
    added = [seq_start(row, ids, prefix_slots=prefix_slots)]
    first = pb.plan(
        [row], [start], [mid - start], ids[start:mid], added=added, replay=[replay] if replay else []
    )
    logits = [runner.token_logits(first)[replay:]]
    logits.append(runner.token_logits(pb.plan([row], [mid], [len(ids) - mid], ids[mid:])))
    tokens = [int(logits[-1][-1].argmax())]
    for pos in range(len(ids), len(ids) + decode - 1):
        logits.append(runner.forward_logits(pb.plan([row], [pos], [1], tokens[-1:])))
        tokens.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), tokens


def _cached_entries(runner, pb: PagedPlanBuilder, row: int, n: int) -> list[torch.Tensor]:
    """Copies of the pool entries (and indexer keys) of row's first n positions, per compressed layer."""
    cache, layers, out = runner.kv_pool, runner.model.attention_layers(), []
    for pools in (cache.entries, cache.index_keys):
        for lid, pool in pools.items():
            rate = layers[lid].compressor.rate
            out.append(pool[[pb.slot(row, p) // rate for p in range(0, n, rate)]].clone())
    return out


def v4_hit_vs_cold(
    runner, prefix_len: int, replay: int, seed: int, page: int = 8, decode: int = 8
) -> HitVsCold:
    """On a DeepSeek-V4 runner (rows 1-3, position-aligned pages): request A = P + its own 7 tokens
    caches the prefix P of `prefix_len` tokens; request B = P + 9 other tokens runs cold in row 2 and as
    a hit on A's pages in row 3 (a reused row), replaying `replay` tokens before the hit."""
    prefix = random_prompt(prefix_len, seed, runner.vocab_size)
    a = prefix + random_prompt(7, seed + 1, runner.vocab_size)
    b = prefix + random_prompt(9, seed + 2, runner.vocab_size)
    pb = PagedPlanBuilder(page, runner.kv_pool.num_slots, seed)
    runner.execute(pb.plan([1], [0], [len(a)], a, added=[seq_start(1, a)]))
    before = _cached_entries(runner, pb, 1, prefix_len)
    cold, cold_tokens = _prefill_and_decode(runner, pb, 2, b, 0, 0, decode)
    slots = pb.share(3, 1, prefix_len)
    hit, hit_tokens = _prefill_and_decode(runner, pb, 3, b, prefix_len, replay, decode, slots)
    after = _cached_entries(runner, pb, 1, prefix_len)
    untouched = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    return HitVsCold(hit, cold[prefix_len:], hit_tokens, cold_tokens, untouched, len(b) - prefix_len)

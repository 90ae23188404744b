"""Routing policies, by sglang-router's names. Each picks one of the healthy candidate workers and says
what kind of decision it was (counted in /metrics).

cache_aware (sglang-router's `policies/cache_aware.rs`, with one tree per worker):
- imbalanced load, when max - min > `balance_abs_threshold` and max > min * `balance_rel_threshold`:
  the least loaded worker (`balance`);
- else the worker whose tree holds the longest prefix of the request text, when that prefix is more
  than `cache_threshold` of the text (`cache_hit`);
- else the least loaded worker, ties to the smallest tree (`fallback`; sglang-router takes the smallest
  tree alone).
The chosen worker's tree then stores the text, in every case.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from runtime.http.gateway.radix_tree import RadixTree
from runtime.http.gateway.workers import Worker


@dataclass(frozen=True)
class Decision:
    worker: Worker
    kind: str  # cache_hit | balance | fallback for cache_aware; the policy's name otherwise


class Policy:
    name: ClassVar[str]
    needs_text: ClassVar[bool] = False  # whether `choose` reads the request text

    def choose(self, candidates: Sequence[Worker], text: str) -> Decision:
        """One of `candidates` (healthy workers, never empty) for a request whose text is `text`."""
        raise NotImplementedError

    def on_add(self, worker: Worker) -> None:
        """A worker joined the pool (policies with per-worker state set it up here)."""

    def on_remove(self, worker: Worker) -> None:
        """A worker left the pool."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, candidates: Sequence[Worker], text: str) -> Decision:
        w = candidates[self.next % len(candidates)]
        self.next += 1
        return Decision(w, self.name)


class Random(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Worker], text: str) -> Decision:
        return Decision(self.rng.choice(candidates), self.name)


class PowerOfTwo(Policy):
    """Two workers at random; the less loaded of them (the first on a tie)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Worker], text: str) -> Decision:
        if len(candidates) == 1:
            return Decision(candidates[0], self.name)
        a, b = self.rng.sample(list(candidates), 2)
        return Decision(b if b.load < a.load else a, self.name)


class CacheAware(Policy):
    name = "cache_aware"
    needs_text = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 1 << 26,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.trees: dict[Worker, RadixTree] = {}

    def tree(self, w: Worker) -> RadixTree:
        if w not in self.trees:
            self.trees[w] = RadixTree(self.max_tree_size)
        return self.trees[w]

    def on_add(self, worker: Worker) -> None:
        self.tree(worker)

    def on_remove(self, worker: Worker) -> None:
        self.trees.pop(worker, None)

    def imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.load for w in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, candidates: Sequence[Worker], text: str) -> Decision:
        if self.imbalanced(candidates):
            decision = Decision(self._least_loaded(candidates), "balance")
        else:
            matched, best = max(
                ((self.tree(w).match(text), w) for w in candidates), key=lambda m: (m[0], -m[1].load)
            )
            if text and matched / len(text) > self.cache_threshold:
                decision = Decision(best, "cache_hit")
            else:
                decision = Decision(self._least_loaded(candidates), "fallback")
        if text:
            self.tree(decision.worker).insert(text)
        return decision

    def _least_loaded(self, candidates: Sequence[Worker]) -> Worker:
        return min(candidates, key=lambda w: (w.load, self.tree(w).chars))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (CacheAware, RoundRobin, PowerOfTwo, Random)}

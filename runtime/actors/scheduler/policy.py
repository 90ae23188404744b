"""Admission order of the waiting queue: `fcfs` (priority first, then arrival) or `lpm` (longest cached
prefix first, which keeps shared prefixes hot; like SGLang it falls back to FCFS on long queues, where
matching every request each step would cost more than it saves)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.actors.scheduler.prefix_cache import PrefixCache
    from runtime.actors.scheduler.request import Req

POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128


def order_waiting(waiting: deque[Req], policy: str, cache: PrefixCache) -> None:
    if len(waiting) < 2:
        return
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        matched = {id(r): len(cache.match(r)[0]) for r in waiting}
        key = lambda r: (r.retractions == 0, -r.priority, -matched[id(r)], r.arrival)  # noqa: E731
    else:
        key = lambda r: (r.retractions == 0, -r.priority, r.arrival)  # noqa: E731
    ordered = sorted(waiting, key=key)
    waiting.clear()
    waiting.extend(ordered)

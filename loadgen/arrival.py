"""When requests are sent: a Poisson process at --request-rate (inf: all at once), bounded by a
count (the items run out) or by a duration. Clock, sleep and rng are injectable for tests."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def next_gap(rate: float, rng: np.random.Generator) -> float:
    """Seconds to the next arrival: exponential with mean 1/rate; 0 for an infinite rate."""
    return 0.0 if math.isinf(rate) else float(rng.exponential(1.0 / rate))


async def paced(
    items: Iterable[T],
    rate: float,
    rng: np.random.Generator,
    *,
    duration: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> AsyncIterator[T]:
    """Yield items at Poisson arrival times. Times are absolute from the start, so a consumer that
    blocks (a full concurrency limit) is followed by a catch-up burst, not a drift. Stops when the
    items run out or the next arrival would fall at or after `duration` seconds."""
    start = clock()
    due = 0.0  # the first request goes at t=0
    for item in items:
        if duration is not None and (due >= duration or clock() - start >= duration):
            return
        wait = start + due - clock()
        if wait > 0:
            await sleep(wait)
        yield item
        due += next_gap(rate, rng)

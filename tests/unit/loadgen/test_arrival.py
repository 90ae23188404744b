from __future__ import annotations

import asyncio

import numpy as np

from loadgen.arrival import paced


class FakeClock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


def _send_times(n: int, rate: float, duration: float | None = None, seed: int = 0) -> list[float]:
    clock = FakeClock()

    async def go():
        return [
            clock()
            async for _ in paced(
                range(n), rate, np.random.default_rng(seed), duration=duration, clock=clock, sleep=clock.sleep
            )  # fmt: skip
        ]

    return asyncio.run(go())


def test_poisson_mean_inter_arrival_is_one_over_rate():
    for rate in (0.5, 10.0, 200.0):
        gaps = np.diff(_send_times(20_000, rate))
        assert abs(gaps.mean() - 1 / rate) < 0.03 / rate
        # exponential: the standard deviation equals the mean
        assert abs(gaps.std() - 1 / rate) < 0.05 / rate


def test_infinite_rate_sends_everything_at_once():
    times = _send_times(50, float("inf"))
    assert len(times) == 50 and max(times) == min(times)


def test_duration_bounds_an_endless_stream():
    def endless():
        while True:
            yield 0

    clock = FakeClock()

    async def go():
        return [clock() async for _ in paced(endless(), 20.0, np.random.default_rng(1), duration=5.0,
                                             clock=clock, sleep=clock.sleep)]  # fmt: skip

    times = asyncio.run(go())
    assert max(times) - 100.0 < 5.0
    assert 60 < len(times) < 140  # about rate x duration

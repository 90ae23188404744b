"""`benchmarks.kernels.timing.round_robin_medians`, the timing loop of the MLA bench and the decode sweep: runs are
timed round-robin (each round starting one run later, against the clock's warm-up bias) and each keeps
its median; a run that fails once is not retried and reports its exception."""

from __future__ import annotations

from benchmarks.kernels.timing import round_robin, round_robin_medians


def test_each_round_starts_one_run_later():
    assert list(round_robin(3, 3)) == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_medians_and_a_failing_run():
    calls: list[str] = []
    samples = {"a": iter([5.0, 1.0, 3.0]), "c": iter([2.0, 9.0, 4.0])}

    def timing(name: str):
        def run() -> float:
            calls.append(name)
            if name == "b":
                raise RuntimeError("no kernel")
            return next(samples[name])

        return run

    a, b, c = round_robin_medians([timing("a"), timing("b"), timing("c")], 3)
    assert (a, c) == (3.0, 4.0)
    assert isinstance(b, RuntimeError) and str(b) == "no kernel"
    assert calls == ["a", "b", "c", "c", "a", "c", "a"]  # b is called once

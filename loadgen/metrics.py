"""Benchmark metrics, defined as SGLang's bench_serving defines them so figures compare.

- duration: first request sent to last answer received.
- throughput: completed requests, input, output and total tokens per second of duration.
- concurrency: sum of E2E latencies / duration (the mean number of requests in flight).
- TTFT: send to first content chunk. ITL: gaps between content chunks (all requests pooled).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
Token counts come from the server's usage where it reported one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from loadgen.records import RequestResult

STATS = ("mean", "median", "p90", "p99", "max")
LATENCIES = ("ttft", "itl", "tpot", "e2e")


@dataclass
class Stats:
    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of_ms(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls()
        a = np.asarray(seconds, dtype=np.float64) * 1000.0
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))


@dataclass
class Metrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float  # tok/s
    total_throughput: float  # tok/s
    concurrency: float
    ttft_ms: Stats = field(default_factory=Stats)
    itl_ms: Stats = field(default_factory=Stats)
    tpot_ms: Stats = field(default_factory=Stats)
    e2e_ms: Stats = field(default_factory=Stats)
    usage_reported: int = 0  # completed requests whose answer carried usage
    retokenized_output_tokens: int | None = None
    token_mismatches: int | None = None  # requests whose usage differs from the retokenized count

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Metrics:
        d = dict(d)
        for k in LATENCIES:
            d[f"{k}_ms"] = Stats(**d.get(f"{k}_ms", {}))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def tpot_s(r: RequestResult) -> float | None:
    n = r.output_tokens
    return (r.e2e_s - r.ttft_s) / (n - 1) if n > 1 else None


def compute(results: list[RequestResult], duration_s: float) -> Metrics:
    ok = [r for r in results if r.success]
    dur = max(duration_s, 1e-9)
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    retok = [r for r in ok if r.retokenized_output_tokens is not None]
    return Metrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        request_throughput=len(ok) / dur,
        input_throughput=n_in / dur,
        output_throughput=n_out / dur,
        total_throughput=(n_in + n_out) / dur,
        concurrency=sum(r.e2e_s for r in ok) / dur,
        ttft_ms=Stats.of_ms([r.ttft_s for r in ok]),
        itl_ms=Stats.of_ms([g for r in ok for g in r.itl_s]),
        tpot_ms=Stats.of_ms([t for r in ok if (t := tpot_s(r)) is not None]),
        e2e_ms=Stats.of_ms([r.e2e_s for r in ok]),
        usage_reported=sum(r.completion_tokens is not None for r in ok),
        retokenized_output_tokens=sum(r.retokenized_output_tokens for r in retok) if retok else None,
        token_mismatches=(
            sum(
                r.completion_tokens is not None and r.completion_tokens != r.retokenized_output_tokens
                for r in retok
            )
            if retok
            else None
        ),
    )


def benchmark_duration(results: list[RequestResult]) -> float:
    """First send to last answer, over every request (failed ones included)."""
    if not results:
        return 0.0
    return max(r.end_s for r in results) - min(r.start_s for r in results)

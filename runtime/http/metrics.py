"""Prometheus metrics: request counters and latency histograms observed here, engine gauges read
from `engine.stats` at scrape time. One registry per app, so tests can build many apps."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from runtime.http.engine import Engine
from runtime.http.generation import Choice
from runtime.mailbox.messages import EngramCounters, SpecCounters, TextDelta

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator:
        s = self.engine.stats
        yield GaugeMetricFamily(
            "conduit_healthy", "1 when the engine is healthy", value=int(self.engine.healthy)
        )
        if s is None:
            return
        for name, doc, value in (
            ("conduit_num_requests_running", "Requests in the running batch", s.running),
            ("conduit_num_requests_waiting", "Requests waiting to be scheduled", s.waiting),
            ("conduit_kv_pages_used", "KV cache pages in use", s.kv_pages_used),
            ("conduit_kv_pages_total", "KV cache pages in the pool", s.kv_pages_total),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "conduit_kv_cache_usage_ratio",
            "Used / total KV pages",
            value=s.kv_pages_used / max(1, s.kv_pages_total),
        )
        yield CounterMetricFamily(
            "conduit_engine_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (engine)",
            value=s.cached_tokens,
        )
        yield CounterMetricFamily(
            "conduit_engine_prompt_tokens", "Prompt tokens admitted (engine)", value=s.prompt_tokens
        )
        yield CounterMetricFamily(
            "conduit_engine_retractions", "Requests retracted for KV space", value=s.retractions
        )
        yield CounterMetricFamily(
            "conduit_swa_replay_tokens",
            "Tokens recomputed before prefix-cache hits to rebuild per-request state (SWA bounded replay)",
            value=s.swa_replay_tokens,
        )
        yield GaugeMetricFamily(
            "conduit_prefix_cache_hit_rate",
            "Cached / admitted prompt tokens since start (engine)",
            value=s.cached_tokens / max(1, s.prompt_tokens),
        )
        yield GaugeMetricFamily(
            "conduit_radix_cache_evictable_tokens", "Cached tokens no request uses", value=s.evictable_tokens
        )
        yield GaugeMetricFamily(
            "conduit_radix_cache_protected_tokens",
            "Cached tokens locked by running requests",
            value=s.protected_tokens,
        )
        yield CounterMetricFamily("conduit_scheduler_steps", "Steps planned by the scheduler", value=s.steps)
        for name, doc, value in (
            ("conduit_scheduler_plan_seconds", "Scheduler time planning steps", s.plan_s),
            (
                "conduit_scheduler_wait_seconds",
                "Scheduler time idle with steps in flight (waiting for the worker)",
                s.wait_s,
            ),
            ("conduit_scheduler_output_seconds", "Scheduler time processing step outputs", s.output_s),
            ("conduit_gpu_busy_seconds", "Device time inside steps (CUDA)", s.gpu_busy_s),
            ("conduit_gpu_idle_seconds", "Device idle time between consecutive steps (CUDA)", s.gpu_idle_s),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        if s.spec is not None:
            yield from _speculation(s.spec)
        if s.engram is not None:
            yield from _engram(s.engram)


def _engram(c: EngramCounters) -> Iterator:
    """Engram lookups: steps that looked rows up, rows fetched, fetch time, and the time the forward
    waited for rows (what the prefetch did not hide)."""
    for name, doc, value in (
        ("conduit_engram_lookups", "Engram lookups (one per step)", c.lookups),
        ("conduit_engram_rows_fetched", "Engram table rows fetched", c.rows),
        ("conduit_engram_fetch_seconds", "Time from an Engram fetch's start to its rows", c.fetch_s),
        ("conduit_engram_wait_seconds", "Time the forward waited for Engram rows", c.wait_s),
        ("conduit_engram_shard_restarts", "Engram shard processes restarted after a crash", c.shard_restarts),
    ):
        yield CounterMetricFamily(name, doc, value=value)


def _speculation(c: SpecCounters) -> Iterator:
    """Speculative decoding: drafts verified and accepted, the accepted length's distribution (as a
    histogram: tokens a verify row emitted), acceptance per draft position, drafting and verify time."""
    for name, doc, value in (
        ("conduit_spec_verify_steps", "Steps with a row verifying drafts", c.steps),
        ("conduit_spec_verify_rows", "Rows that verified drafts (one row in one step)", c.rows),
        (
            "conduit_spec_ahead_rows",
            "Verify rows planned before their previous verify step came back",
            c.ahead_rows,
        ),
        ("conduit_spec_draft_tokens", "Draft tokens verified", c.drafted),
        ("conduit_spec_accepted_tokens", "Draft tokens accepted", c.accepted),
        ("conduit_spec_draft_seconds", "Time spent drafting (device time on CUDA)", c.draft_s),
        ("conduit_spec_verify_seconds", "Time of the steps with verify rows", c.verify_s),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    yield GaugeMetricFamily(
        "conduit_spec_accept_length_mean",
        "Mean tokens a verify row emitted (accepted drafts + 1)",
        value=(c.accepted + c.rows) / max(1, c.rows),
    )
    hist = HistogramMetricFamily(
        "conduit_spec_accept_length", "Tokens a verify row emitted (accepted drafts + 1)"
    )
    cumulative, buckets = 0, []
    for n, count in enumerate(c.lengths, start=1):
        cumulative += count
        buckets.append((str(n), cumulative))
    hist.add_metric([], buckets + [("+Inf", cumulative)], sum_value=c.accepted + c.rows)
    yield hist
    per = GaugeMetricFamily(
        "conduit_spec_acceptance_by_position",
        "Accepted / verified drafts at each draft position",
        labels=["position"],
    )
    for j, (acc, seen) in enumerate(zip(c.per_position, c.reached, strict=True), start=1):
        per.add_metric([str(j)], acc / max(1, seen))
    yield per


@dataclass
class _Ended:
    """Choices of the request being served (by this task) that ended with a finish reason or an error."""

    choices: int
    ended: int = 0


_REQUEST: contextvars.ContextVar[_Ended | None] = contextvars.ContextVar("conduit_request", default=None)


class Metrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter(
            "conduit_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.finished = Counter(
            "conduit_request_finished",
            "Engine requests (choices) by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "conduit_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("conduit_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "conduit_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "conduit_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "conduit_inter_token_latency_seconds", "Time between tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "conduit_e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "conduit_http_requests_in_flight",
            "Generation requests being served (HTTP and WebSocket)",
            registry=r,
        )
        self.live = 0
        self.idle = asyncio.Event()  # set while no generation request is being served
        self.idle.set()
        r.register(_EngineCollector(engine))

    @contextmanager
    def request(self, choices: int) -> Iterator[None]:
        """Around serving one generation request (HTTP or one WebSocket id): counts it in flight, and
        its choices that end with neither a finish reason nor an error (client aborts and disconnects)
        as finished with reason "abort"."""
        ended = _Ended(choices)
        token = _REQUEST.set(ended)
        self.in_flight.inc()
        self.live += 1
        self.idle.clear()
        try:
            yield
        finally:
            _REQUEST.reset(token)
            self.in_flight.dec()
            self.live -= 1
            if not self.live:
                self.idle.set()
            if ended.ended < choices:
                self.finished.labels("abort").inc(choices - ended.ended)

    def on_delta(self, choice: Choice, delta: TextDelta) -> None:
        """Record timing for a choice's delta; call before `choice.update(delta)`."""
        now = time.monotonic()
        n_tokens = len(delta.token_ids)
        if n_tokens:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.ttft.observe(now - choice.start)
                n_tokens -= 1  # the first token has a TTFT, not an inter-token latency
            elif choice.last_token_at is not None:
                gap = (now - choice.last_token_at) / n_tokens
                for _ in range(n_tokens):
                    self.itl.observe(gap)
            choice.last_token_at = now
        if delta.finish_reason is not None:
            self.e2e.observe(now - choice.start)
            self.finished.labels(delta.finish_reason).inc()
            if (ended := _REQUEST.get()) is not None:
                ended.ended += 1
            self.prompt_tokens.inc(delta.prompt_tokens)
            self.generation_tokens.inc(delta.completion_tokens)
            self.cached_tokens.inc(delta.cached_tokens)

    def on_error(self, n_choices: int) -> None:
        if (ended := _REQUEST.get()) is not None:
            n_choices = min(n_choices, ended.choices - ended.ended)  # those not finished already
            ended.ended += n_choices
        self.finished.labels("error").inc(n_choices)

    def render(self) -> bytes:
        return generate_latest(self.registry)

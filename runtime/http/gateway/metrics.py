"""The gateway's Prometheus metrics: counters observed as requests pass, per-worker gauges (health, in
flight) read from the pool at scrape time. One registry per gateway, so tests can build many."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from runtime.http.gateway.workers import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WorkerCollector(Collector):
    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.workers = workers

    def collect(self) -> Iterator:
        healthy = GaugeMetricFamily(
            "conduit_gateway_worker_healthy", "1 when the worker gets traffic", labels=["worker"]
        )
        in_flight = GaugeMetricFamily(
            "conduit_gateway_requests_in_flight",
            "Requests this gateway has in flight on the worker (its load)",
            labels=["worker"],
        )
        n_healthy = 0
        for w in self.workers():
            healthy.add_metric([w.url], int(w.healthy))
            in_flight.add_metric([w.url], w.load)
            n_healthy += w.healthy
        yield healthy
        yield in_flight
        yield GaugeMetricFamily("conduit_gateway_healthy_workers", "Workers getting traffic", value=n_healthy)


class GatewayMetrics:
    def __init__(self, workers: Callable[[], Iterable[Worker]]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "conduit_gateway_requests",
            "Requests sent to a worker (each attempt), by endpoint",
            ["worker", "endpoint"],
            registry=r,
        )
        self.decisions = Counter(
            "conduit_gateway_routing_decisions",
            "Routing decisions by policy and kind (cache_aware: cache_hit, balance, fallback)",
            ["policy", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "conduit_gateway_retries",
            "Attempts that failed before any byte reached the client and went to another worker",
            ["worker"],
            registry=r,
        )
        self.errors = Counter(
            "conduit_gateway_worker_errors",
            "Worker failures by kind (connect: before the answer began; midstream: after)",
            ["worker", "kind"],
            registry=r,
        )
        r.register(_WorkerCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)

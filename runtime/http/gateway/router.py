"""The gateway's state: its workers, its policy and its metrics, and the one step every request takes
through them, `pick`."""

from __future__ import annotations

from collections.abc import Container

import aiohttp

from runtime.errors import BadGateway, Overloaded
from runtime.http.gateway.config import GatewayConfig
from runtime.http.gateway.metrics import GatewayMetrics
from runtime.http.gateway.policies import POLICIES, CacheAware, Policy
from runtime.http.gateway.workers import Worker, WorkerPool


def make_policy(cfg: GatewayConfig) -> Policy:
    if cfg.policy == "cache_aware":
        return CacheAware(
            cache_threshold=cfg.cache_threshold,
            balance_abs_threshold=cfg.balance_abs_threshold,
            balance_rel_threshold=cfg.balance_rel_threshold,
            max_tree_size=cfg.max_tree_size,
        )
    return POLICIES[cfg.policy]()


class Router:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.policy = make_policy(cfg)
        self.pool = WorkerPool(
            interval=cfg.health_check_interval_secs,
            timeout=cfg.health_check_timeout_secs,
            failure_threshold=cfg.health_failure_threshold,
            success_threshold=cfg.health_success_threshold,
            on_add=self.policy.on_add,
            on_remove=self.policy.on_remove,
        )
        for url in cfg.worker_urls:
            self.pool.add(url)
        self.metrics = GatewayMetrics(lambda: self.pool)
        self.session: aiohttp.ClientSession | None = None  # set while the app runs
        # per proxied HTTP request; the session's own timeout bounds only connecting, so that
        # WebSocket connections to the workers can live as long as their clients'
        self.request_timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_secs, sock_connect=cfg.health_check_timeout_secs
        )

    def pick(
        self, text: str, tried: Container[Worker] = (), last_error: str | None = None, *, route: bool = True
    ) -> Worker:
        """A healthy worker not in `tried` for a request whose routing text is `text`; by the policy when
        `route`, else the least loaded (requests that generate nothing, such as GET /v1/models)."""
        candidates = self.pool.healthy(exclude=tried)
        if not candidates:
            if last_error is not None:
                raise BadGateway(
                    f"No worker could take the request; the last one failed: {last_error}",
                    code="worker_unreachable",
                )
            raise Overloaded("No healthy worker behind the gateway.", status=503, code="no_healthy_worker")
        if not route:
            return min(candidates, key=lambda w: w.load)
        decision = self.policy.choose(candidates, text)
        self.metrics.decisions.labels(self.policy.name, decision.kind).inc()
        return decision.worker

    def failed(self, worker: Worker, kind: str, reason: str) -> None:
        """`worker` refused or dropped a connection: no traffic until its health checks pass."""
        self.metrics.errors.labels(worker.url, kind).inc()
        self.pool.mark_failed(worker, reason)

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
        for url in cfg.prefill_urls if cfg.pd_disaggregation else cfg.worker_urls:
            self.pool.add(url)
        # --pd-disaggregation: `pool` holds the prefill servers, `decode_pool` the decode servers
        self.decode_pool: WorkerPool | None = None
        if cfg.pd_disaggregation:
            self.decode_pool = WorkerPool(
                interval=cfg.health_check_interval_secs,
                timeout=cfg.health_check_timeout_secs,
                failure_threshold=cfg.health_failure_threshold,
                success_threshold=cfg.health_success_threshold,
            )
            for url in cfg.decode_urls:
                self.decode_pool.add(url)
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

    def pick_decode(self) -> Worker:
        """The least loaded healthy decode server (--pd-disaggregation)."""
        assert self.decode_pool is not None
        candidates = self.decode_pool.healthy()
        if not candidates:
            raise Overloaded(
                "No healthy decode server behind the gateway.", status=503, code="no_healthy_worker"
            )
        return min(candidates, key=lambda w: w.load)

    def pools(self) -> list[WorkerPool]:
        return [self.pool] if self.decode_pool is None else [self.pool, self.decode_pool]

    def healthy_count(self) -> int:
        """Healthy workers; with --pd-disaggregation 0 unless both a prefill and a decode one are."""
        n = [len(p.healthy()) for p in self.pools()]
        return sum(n) if all(n) else 0

    def failed(self, worker: Worker, kind: str, reason: str) -> None:
        """`worker` refused or dropped a connection: no traffic until its health checks pass."""
        self.metrics.errors.labels(worker.url, kind).inc()
        for pool in self.pools():
            if pool.workers.get(worker.url) is worker:
                pool.mark_failed(worker, reason)

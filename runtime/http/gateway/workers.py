"""The workers behind the gateway: their health and load, added and removed at run time.

Health comes from two places. Periodic checks (GET /health every `interval` s) flip a worker after
`failure_threshold` consecutive failures or `success_threshold` consecutive successes, as
sglang-router's; a worker's first check decides its state at once. And traffic: a worker that refuses
a connection or drops one mid-answer is marked unhealthy at once (`mark_failed`), and comes back only
through the checks. Load is the number of requests this gateway has in flight on the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass

import aiohttp
import structlog

log = structlog.get_logger("conduit.gateway")


def normalize_url(url: str) -> str:
    """`http://host:port`, without a trailing slash or `/v1`; raises ValueError if not http(s)."""
    url = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"A worker URL is http://host:port, got {url!r}.")
    return url


@dataclass(eq=False)
class Worker:
    url: str
    healthy: bool = False
    load: int = 0  # requests in flight from this gateway
    checked: bool = False  # a health check has answered
    fails: int = 0  # consecutive failed checks
    successes: int = 0  # consecutive passed checks
    last_error: str | None = None

    def record(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "last_error": self.last_error}


class WorkerPool:
    def __init__(
        self,
        *,
        interval: float,
        timeout: float,
        failure_threshold: int,
        success_threshold: int,
        on_add: Callable[[Worker], None] = lambda w: None,
        on_remove: Callable[[Worker], None] = lambda w: None,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.on_add, self.on_remove = on_add, on_remove
        self.workers: dict[str, Worker] = {}
        self.session: aiohttp.ClientSession | None = None

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def healthy(self, exclude: Container[Worker] = ()) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy and w not in exclude]

    def add(self, url: str) -> Worker:
        """Add a worker (not healthy until its first check passes); ValueError if already there."""
        url = normalize_url(url)
        if url in self.workers:
            raise ValueError(f"Worker {url} is already in the pool.")
        self.workers[url] = w = Worker(url)
        self.on_add(w)
        log.info("worker added", worker=url)
        return w

    def remove(self, url: str) -> Worker | None:
        """Take a worker out of rotation; its requests in flight run to their end."""
        w = self.workers.pop(normalize_url(url), None)
        if w is not None:
            self.on_remove(w)
            log.info("worker removed", worker=w.url)
        return w

    def mark_failed(self, w: Worker, reason: str) -> None:
        w.successes = 0
        w.last_error = reason
        if w.healthy:
            w.healthy = False
            log.warning("worker marked unhealthy", worker=w.url, reason=reason)

    async def check(self, w: Worker) -> bool:
        """One health check of `w`; updates its state."""
        assert self.session is not None
        try:
            async with self.session.get(
                f"{w.url}/health", timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as r:
                ok = r.status == 200
                error = None if ok else f"GET /health answered {r.status}"
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, error = False, f"GET /health failed: {type(e).__name__}: {e}"
        first = not w.checked
        w.checked = True
        if ok:
            w.successes, w.fails = w.successes + 1, 0
            if not w.healthy and (first or w.successes >= self.success_threshold):
                w.healthy, w.last_error = True, None
                log.info("worker healthy", worker=w.url)
        else:
            w.fails, w.successes = w.fails + 1, 0
            w.last_error = error
            if w.healthy and w.fails >= self.failure_threshold:
                w.healthy = False
                log.warning("worker marked unhealthy", worker=w.url, reason=error)
            elif first:
                log.warning("worker not healthy", worker=w.url, reason=error)
        return w.healthy

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self))

    async def run_checks(self) -> None:
        """Check every worker now, then every `interval` s, until cancelled."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)

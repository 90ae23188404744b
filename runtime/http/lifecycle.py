"""The server's end of life: draining on SIGTERM/SIGINT.

`drain` stops new generation work (new HTTP generation requests and WebSocket ids get 503 with
Retry-After, /health answers 503 "shutting_down" so load balancers look elsewhere), gives the requests in
flight `timeout` seconds to finish, ends the rest with one final 503 error each (an SSE error event and
`[DONE]`, a WebSocket error frame), then closes the WebSockets. The listening socket is closed by the
caller before (runtime/server.py)."""

from __future__ import annotations

import asyncio
from typing import Protocol

import structlog
from aiohttp import WSCloseCode, web

from runtime.errors import Overloaded
from runtime.http.metrics import Metrics

log = structlog.get_logger("conduit.http")

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
RETRY_AFTER_S = 5.0
CANCEL_GRACE_S = 5.0  # after the deadline: time for the cancelled requests to write their final event


class Cancellable(Protocol):
    def cancel_all(self, message: str) -> int: ...


class Lifecycle:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.draining = False
        self.websockets: set[web.WebSocketResponse] = set()

    def refuse(self) -> Overloaded:
        return shutting_down("The server is shutting down; retry on another replica or later.")

    async def drain(self, client: Cancellable, timeout: float, skip: asyncio.Event | None = None) -> None:
        """Finish what is in flight within `timeout` s (less if `skip` is set: a second signal)."""
        self.draining = True
        live = self.metrics.live
        log.info("draining", in_flight=live, timeout_s=timeout)
        if live and not await _wait_any(self.metrics.idle, skip, timeout):
            n = client.cancel_all("The server is shutting down; the request was not finished in time.")
            log.warning("drain_deadline", cancelled=n)
            await _wait_any(self.metrics.idle, None, CANCEL_GRACE_S)
        for ws in list(self.websockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        log.info("drained", in_flight=self.metrics.live)


async def _wait_any(event: asyncio.Event, skip: asyncio.Event | None, timeout: float) -> bool:
    """Wait for `event` (True), `skip`, or the timeout (False)."""
    waits = [asyncio.ensure_future(event.wait())]
    if skip is not None:
        waits.append(asyncio.ensure_future(skip.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return event.is_set()


def shutting_down(message: str) -> Overloaded:
    err = Overloaded(message, status=503, retry_after=RETRY_AFTER_S, code="shutting_down")
    err.type = "server_error"
    return err


LIFECYCLE_KEY: web.AppKey[Lifecycle] = web.AppKey("lifecycle", Lifecycle)


@web.middleware
async def drain_middleware(request: web.Request, handler) -> web.StreamResponse:
    """While draining, new generation requests are refused (before their body is read)."""
    lifecycle = request.app.get(LIFECYCLE_KEY)
    if lifecycle is not None and lifecycle.draining and request.path in GENERATION_ROUTES:
        raise lifecycle.refuse()
    return await handler(request)

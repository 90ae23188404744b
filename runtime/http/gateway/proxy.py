"""The OpenAI routes, proxied: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Each request goes to the worker its policy picks. A failure before any byte has reached the client
(connection refused, or lost before the answer's first byte) marks that worker unhealthy and the
request goes to another one, up to `--retry-max-retries` attempts. Once bytes have gone out, a lost
worker ends the stream with an SSE error event (`data: {"error": ...}`, then `data: [DONE]`). A
streamed answer goes through event by event as the worker writes it: a read is cut after its last
complete event, and only the incomplete tail is held back until the rest of it arrives.
Non-2xx answers of a worker (bad input, overload) pass through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import aiohttp
import structlog
from aiohttp import web

from runtime.errors import BadGateway
from runtime.http.formatting import DONE, sse
from runtime.http.gateway.request_text import request_text
from runtime.http.gateway.router import Router
from runtime.http.gateway.workers import Worker

log = structlog.get_logger("conduit.gateway")

_REQUEST_HEADERS = ("Content-Type", "Authorization", "Accept", "X-Request-Id")
_RESPONSE_HEADERS = ("Content-Type", "Cache-Control", "X-Request-Id", "Retry-After")


class _Retry(Exception):
    """This attempt failed before any byte reached the client: try another worker."""


class _Lost(Exception):
    """The worker's answer broke off (`timed_out`: it ran past --request-timeout-secs)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _copy(headers, names) -> dict[str, str]:
    return {k: headers[k] for k in names if k in headers}


class HttpProxy:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.pd = None
        if router.decode_pool is not None:
            from runtime.http.gateway.pd import PDProxy

            self.pd = PDProxy(router)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.models)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, "completions")

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self.forward(request, "models")

    async def forward(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        router = self.router
        body = await request.read() if request.method == "POST" else None
        if self.pd is not None and body is not None:
            return await self.pd.forward(request, endpoint, body)
        text = request_text(endpoint, body) if body and router.policy.needs_text else ""
        tried: list[Worker] = []
        last_error: str | None = None
        for _ in range(max(1, router.cfg.retry_max_retries)):
            worker = router.pick(text, tried, last_error, route=endpoint != "models")
            if tried:
                router.metrics.retries.labels(tried[-1].url).inc()
            tried.append(worker)
            with structlog.contextvars.bound_contextvars(worker=worker.url):
                try:
                    return await self._attempt(request, worker, body, endpoint)
                except _Retry as e:
                    last_error = str(e)
                    log.warning("worker failed before answering; retrying elsewhere", error=last_error)
                    router.failed(worker, "connect", last_error)
        raise BadGateway(f"{len(tried)} attempt(s) failed; the last: {last_error}", code="worker_unreachable")

    async def _attempt(
        self, request: web.Request, worker: Worker, body: bytes | None, endpoint: str
    ) -> web.StreamResponse:
        router = self.router
        assert router.session is not None
        router.metrics.requests.labels(worker.url, endpoint).inc()
        worker.load += 1
        try:
            try:
                upstream = await router.session.request(
                    request.method,
                    worker.url + request.path_qs,
                    data=body,
                    headers=_copy(request.headers, _REQUEST_HEADERS),
                    timeout=router.request_timeout,
                )
            except aiohttp.ClientConnectionError as e:
                raise _Retry(f"{type(e).__name__}: {e}") from None
            except TimeoutError:
                raise BadGateway("The worker did not answer in time.", code="worker_timeout") from None
            async with upstream:
                stream = upstream.status == 200 and upstream.content_type == "text/event-stream"
                if stream:
                    return await self._stream(request, worker, upstream)
                try:
                    data = await upstream.read()
                except TimeoutError:  # --request-timeout-secs: slow, not lost
                    raise BadGateway("The worker did not answer in time.", code="worker_timeout") from None
                except aiohttp.ClientError as e:
                    raise _Retry(f"{type(e).__name__}: {e}") from None
                return web.Response(
                    status=upstream.status, body=data, headers=_copy(upstream.headers, _RESPONSE_HEADERS)
                )
        finally:
            worker.load -= 1

    async def _stream(
        self, request: web.Request, worker: Worker, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        resp: web.StreamResponse | None = None
        try:
            async with aclosing(_events(upstream)) as events:
                async for chunk in events:
                    if resp is None:  # headers go out with the first event, so a failure before it retries
                        resp = web.StreamResponse(headers=_copy(upstream.headers, _RESPONSE_HEADERS))
                        await resp.prepare(request)
                    await resp.write(chunk)
        except _Lost as e:
            if resp is None and e.timed_out:
                raise BadGateway("The worker did not answer in time.", code="worker_timeout") from None
            if resp is None:
                raise _Retry(str(e)) from None
            if e.timed_out:
                err = BadGateway("The worker did not finish in time.", code="worker_timeout")
            else:
                log.warning("worker lost mid-stream", error=str(e))
                self.router.failed(worker, "midstream", str(e))
                err = BadGateway(
                    f"The worker serving this request failed mid-stream: {e}", code="worker_failed"
                )
            try:
                await resp.write(sse(err.body()) + DONE)
                await resp.write_eof()
            except ConnectionResetError:
                pass
            return resp
        except ConnectionResetError:
            log.info("client disconnected mid-stream")
            upstream.close()  # the worker sees its client go and aborts the request
            assert resp is not None
            return resp
        assert resp is not None
        try:
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


async def _events(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The worker's SSE bytes, each read cut after its last complete event; raises `_Lost` if the
    stream breaks off or ends without `data: [DONE]`."""
    pending = b""
    done = False
    started = time.monotonic()
    try:
        async for chunk in upstream.content.iter_any():
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                pending = data
                continue
            out, pending = data[:cut], data[cut:]
            done = out.endswith(DONE)
            yield out
    except TimeoutError:
        raise _Lost(f"timed out after {time.monotonic() - started:.1f}s", timed_out=True) from None
    except aiohttp.ClientError as e:
        raise _Lost(f"{type(e).__name__}: {e} after {time.monotonic() - started:.1f}s") from None
    if not done:
        raise _Lost("the stream ended without `data: [DONE]`")

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

from contextlib import aclosing

import aiohttp
import structlog
from aiohttp import web

from runtime.errors import BadGateway
from runtime.http.formatting import DONE, sse
from runtime.http.gateway.pd import PDProxy
from runtime.http.gateway.request_text import request_text
from runtime.http.gateway.router import Router
from runtime.http.gateway.upstream import REQUEST_HEADERS, RESPONSE_HEADERS, Lost, copy_headers, sse_events
from runtime.http.gateway.workers import Worker

log = structlog.get_logger("conduit.gateway")


class _Retry(Exception):
    """This attempt failed before any byte reached the client: try another worker."""


class HttpProxy:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.pd = None
        if router.decode_pool is not None:
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
                    headers=copy_headers(request.headers, REQUEST_HEADERS),
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
                    status=upstream.status,
                    body=data,
                    headers=copy_headers(upstream.headers, RESPONSE_HEADERS),
                )
        finally:
            worker.load -= 1

    async def _stream(
        self, request: web.Request, worker: Worker, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        resp: web.StreamResponse | None = None
        try:
            async with aclosing(sse_events(upstream)) as events:
                async for chunk in events:
                    if resp is None:  # headers go out with the first event, so a failure before it retries
                        resp = web.StreamResponse(headers=copy_headers(upstream.headers, RESPONSE_HEADERS))
                        await resp.prepare(request)
                    await resp.write(chunk)
        except Lost as e:
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

"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

A streaming response is not started until the first delta arrives, so an error the engine raises
before any token (prompt too long, overload) is still a plain 4xx/5xx JSON answer. After that, an
error is sent as an SSE `data: {"error": ...}` event, and every stream ends with `data: [DONE]`.
A client that goes away aborts its engine requests (see `cancel_on_disconnect`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

import msgspec
import structlog
from aiohttp import web

from runtime.errors import ConduitError
from runtime.http.engine import Engine
from runtime.http.formatting import DONE, ChunkWriter, ResponseBuilder, sse
from runtime.http.generation import run_job
from runtime.http.metrics import Metrics
from runtime.http.options import ServingOptions
from runtime.http.protocol import Job, parse_chat, parse_completion

log = structlog.get_logger("conduit.http")

DISCONNECT_POLL_S = 0.5
WRITE_TIMEOUT_S = 60.0  # a client that takes no stream data for this long is treated as gone


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    """Write or, when the client has stopped reading (its socket buffers full), give up on it."""
    try:
        # in the handler's own task: written from another (asyncio.wait_for's), the streamed response
        # ended as a client disconnect and went uncounted in /metrics
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            await resp.write(data)
    except TimeoutError:
        raise ConnectionResetError("the client stopped reading") from None


@asynccontextmanager
async def cancel_on_disconnect(request: web.Request) -> AsyncIterator[None]:
    """Cancel the handler when its client goes away. aiohttp does that itself only when the server
    runs with `handler_cancellation=True` (not its default since 3.9); otherwise poll the transport."""
    if _server_cancels_handlers(request):
        yield
        return
    handler = asyncio.current_task()
    assert handler is not None

    async def watch() -> None:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(DISCONNECT_POLL_S)
        log.info("client disconnected; aborting")
        handler.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


def _server_cancels_handlers(request: web.Request) -> bool:
    # aiohttp keeps the flag on the connection's private manager; if that moves, we fall back to polling
    manager = getattr(request.protocol, "_manager", None)
    return getattr(manager, "handler_cancellation", False) is True


class OpenAIRoutes:
    def __init__(
        self, engine: Engine, metrics: Metrics, served_model: str, options: ServingOptions | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.served_model = served_model
        self.options = options
        self.created = int(time.time())

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        job = parse_chat(
            await request.read(),
            served_model=self.served_model,
            max_model_len=self._max_len(),
            options=self.options,
        )
        return await self._serve(request, job)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        job = parse_completion(
            await request.read(),
            served_model=self.served_model,
            max_model_len=self._max_len(),
            options=self.options,
        )
        return await self._serve(request, job)

    def _max_len(self) -> int:
        return getattr(self.engine, "max_model_len", 0) or 0

    def _model_card(self) -> dict:
        return {
            "id": self.served_model,
            "object": "model",
            "created": self.created,
            "owned_by": "conduit",
            "max_model_len": self._max_len(),
        }

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.served_model:
            raise web.HTTPNotFound()
        return web.json_response(self._model_card())

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        with structlog.contextvars.bound_contextvars(rid=job.id):
            log.debug("request", endpoint=job.endpoint, choices=len(job.requests), stream=job.stream)
            with self.metrics.request(len(job.requests)):
                async with cancel_on_disconnect(request):
                    if job.stream:
                        return await self._stream(request, job)
                    return await self._complete(job)

    async def _complete(self, job: Job) -> web.Response:
        builder = ResponseBuilder(job)
        try:
            async with aclosing(run_job(self.engine, job)) as events:
                async for i, delta in events:
                    self.metrics.on_delta(builder.choices[i], delta)
                    builder.choices[i].update(delta)
                    builder.add(i, delta)
        except ConduitError:
            self.metrics.on_error(len(job.requests))
            raise
        body = msgspec.json.encode(builder.body())
        return web.Response(body=body, content_type="application/json", headers={"X-Request-Id": job.id})

    async def _stream(self, request: web.Request, job: Job) -> web.StreamResponse:
        writer = ChunkWriter(job)
        async with aclosing(run_job(self.engine, job)) as events:
            try:
                first = await anext(events, None)  # errors before any token: a plain JSON error response
            except ConduitError:
                self.metrics.on_error(len(job.requests))
                raise
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": job.id,
                }
            )
            await resp.prepare(request)
            try:
                await _write(resp, writer.start())
                item = first
                while item is not None:
                    i, delta = item
                    self.metrics.on_delta(writer.choices[i], delta)
                    writer.choices[i].update(delta)
                    if chunk := writer.delta(i, delta):
                        await _write(resp, chunk)
                    item = await anext(events, None)
                tail = writer.finish()
            except ConnectionResetError:
                log.info("client disconnected mid-stream; aborting")
                return resp
            except ConduitError as err:
                log.warning("request failed mid-stream", status=err.status, error=err.message)
                self.metrics.on_error(len(job.requests))
                tail = sse(err.body())
            except Exception:
                log.exception("unhandled error mid-stream")
                self.metrics.on_error(len(job.requests))
                tail = sse(ConduitError("Internal server error").body())
        try:
            await _write(resp, tail + DONE)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client disconnected before the end of the stream")
        return resp

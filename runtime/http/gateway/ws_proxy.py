"""GET /v1/ws through the gateway, routed per request (docs/websocket.md has the protocol).

A client socket may hold requests on several workers at once: each `generate` goes to the worker its
policy picks, over one upstream socket per (client socket, worker), opened on first use. Frames go
through unchanged, one by one, in both directions; the gateway reads only `type` and `id` to know
where a request lives (an `abort` follows its request) and when it ends (`done` or `error`). A frame
it cannot route (not JSON, binary, an unknown type) goes to any worker, which answers with the same
error a direct server gives.

If a worker's socket drops, every request live on it ends with an `error` (code `worker_failed`) and
the worker is marked unhealthy; the client socket stays open. Opening or writing to a worker's socket
fails before the request reached it, so that `generate` goes to another worker. Closing the client
socket closes its upstream sockets, which aborts their requests in the workers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import WSMsgType, web

from runtime.errors import BadGateway, ConduitError, InvalidRequest
from runtime.http.gateway.request_text import request_text
from runtime.http.gateway.router import Router
from runtime.http.gateway.workers import Worker

log = structlog.get_logger("conduit.gateway.ws")

MAX_MESSAGE_BYTES = 64 << 20  # as the server's socket


class _Frame(msgspec.Struct):
    type: Any = None
    id: Any = None
    endpoint: Any = "chat"
    request: msgspec.Raw = msgspec.Raw()  # empty when absent


_decode_frame = msgspec.json.Decoder(_Frame).decode


def _read(data: str | bytes) -> _Frame | None:
    try:
        return _decode_frame(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class WebSocketProxy:
    def __init__(self, router: Router) -> None:
        self.router = router

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/ws", self.handle)

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        session = _Session(self.router, ws)
        try:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await session.on_client_frame(msg.data)
        finally:
            await session.close()
        return ws


class _Session:
    def __init__(self, router: Router, ws: web.WebSocketResponse) -> None:
        self.router = router
        self.ws = ws
        self.upstreams: dict[Worker, aiohttp.ClientWebSocketResponse] = {}
        self.readers: dict[Worker, asyncio.Task] = {}
        self.live: dict[str, Worker] = {}  # client id -> the worker running it
        self.send_lock = asyncio.Lock()
        self.closing = False

    async def send(self, data: str) -> None:
        async with self.send_lock:
            if not self.ws.closed:
                await self.ws.send_str(data)

    async def send_error(self, cid: str | None, err: ConduitError) -> None:
        await self.send(
            msgspec.json.encode({"type": "error", "id": cid, "error": err.body()["error"]}).decode()
        )

    async def on_client_frame(self, data: str | bytes) -> None:
        frame = _read(data)
        cid = frame.id if frame is not None and isinstance(frame.id, str) else None
        if frame is not None and frame.type == "abort" and cid is not None:
            if (w := self.live.get(cid)) is not None and w in self.upstreams:
                await self._send_upstream(w, data)
            return  # aborting an unknown or finished id is a no-op, as on a server
        if frame is not None and frame.type == "generate" and cid is not None and frame.request:
            if cid in self.live:
                await self.send_error(cid, InvalidRequest(f"Request id `{cid}` is already live.", param="id"))
                return
            endpoint = frame.endpoint if frame.endpoint in ("chat", "completions") else "chat"
            text = request_text(endpoint, bytes(frame.request)) if self.router.policy.needs_text else ""
            await self._route(cid, data, text)
            return
        # a worker answers what is wrong with it: one this socket already talks to, if any
        for worker in list(self.upstreams):
            try:
                await self._send_upstream(worker, data)
                return
            except (aiohttp.ClientError, ConnectionError):
                continue
        await self._route(None, data, "")

    async def _route(self, cid: str | None, data: str | bytes, text: str) -> None:
        router = self.router
        tried: list[Worker] = []
        last_error: str | None = None
        for _ in range(max(1, router.cfg.retry_max_retries)):
            try:
                worker = router.pick(text, tried, last_error)
            except ConduitError as err:
                await self.send_error(cid, err)
                return
            if tried:
                router.metrics.retries.labels(tried[-1].url).inc()
            tried.append(worker)
            router.metrics.requests.labels(worker.url, "ws").inc()
            if cid is not None:
                self.live[cid] = worker
                worker.load += 1
            try:
                await self._send_upstream(worker, data)
                return
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
                last_error = f"{type(e).__name__}: {e}"
                if cid is not None:
                    if self.live.get(cid) is not worker:
                        return  # its socket's reader has already ended it with an error
                    del self.live[cid]
                    worker.load -= 1
                log.warning("worker socket failed; retrying elsewhere", worker=worker.url, error=last_error)
                router.failed(worker, "connect", last_error)
        await self.send_error(
            cid,
            BadGateway(f"{len(tried)} attempt(s) failed; the last: {last_error}", code="worker_unreachable"),
        )

    async def _send_upstream(self, worker: Worker, data: str | bytes) -> None:
        up = self.upstreams.get(worker)
        if up is None or up.closed:
            assert self.router.session is not None
            up = await self.router.session.ws_connect(f"{worker.url}/v1/ws", max_msg_size=MAX_MESSAGE_BYTES)
            self.upstreams[worker] = up
            self.readers[worker] = asyncio.create_task(self._pump(worker, up), name=f"ws-up-{worker.url}")
        if isinstance(data, bytes):
            await up.send_bytes(data)
        else:
            await up.send_str(data)

    async def _pump(self, worker: Worker, up: aiohttp.ClientWebSocketResponse) -> None:
        """Forward the worker's frames to the client; settle the live ids if its socket drops."""
        reason = "the worker closed its socket"
        try:
            async for msg in up:
                if msg.type == WSMsgType.TEXT:
                    f = _read(msg.data)
                    if f is not None and f.type in ("done", "error") and isinstance(f.id, str):
                        if self.live.get(f.id) is worker:  # settled before the client can reuse the id
                            del self.live[f.id]
                            worker.load -= 1
                    await self.send(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    reason = f"socket error: {up.exception()}"
        except (aiohttp.ClientError, ConnectionError) as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            if self.upstreams.get(worker) is up:
                del self.upstreams[worker]
                self.readers.pop(worker, None)
        if self.closing:
            return
        lost = [cid for cid, w in self.live.items() if w is worker]
        self.router.failed(worker, "midstream" if lost else "connect", reason)
        log.warning("worker socket lost", worker=worker.url, live=len(lost), reason=reason)
        for cid in lost:
            del self.live[cid]
            worker.load -= 1
            await self.send_error(
                cid, BadGateway(f"The worker serving this request failed: {reason}", code="worker_failed")
            )

    async def close(self) -> None:
        """The client socket is gone: close every upstream socket (the workers abort what was live)."""
        self.closing = True
        for worker in self.live.values():
            worker.load -= 1
        self.live.clear()
        await asyncio.gather(*(up.close() for up in self.upstreams.values()), return_exceptions=True)
        readers = list(self.readers.values())
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

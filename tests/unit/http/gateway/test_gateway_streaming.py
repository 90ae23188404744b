"""The gateway's SSE passthrough at the byte level, against a scripted worker (an aiohttp app that
writes exactly the bytes a test wants, when it wants; the real replicas are in
tests/integration/test_gateway.py): events go out as the worker writes them, an event split across
reads goes out whole, a worker lost mid-event ends the stream with an error event and never a torn
one, a client that goes away takes the worker's connection with it, and a worker's WebSocket that
drops ends its live requests with errors while the client's socket stays open."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from runtime.http.gateway import GatewayConfig, build_gateway_app


class ScriptedWorker:
    """POST /v1/completions streams `first`, waits for `go`, then `rest`; or, with `die`, drops the
    connection instead of sending `rest`."""

    def __init__(self, first: bytes, rest: bytes, die: bool = False) -> None:
        self.first, self.rest, self.die = first, rest, die
        self.go = asyncio.Event()
        self.gone = asyncio.Event()  # the gateway closed the connection (its client went away)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/ws", self.websocket)
        return app

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        """Answers a `generate` with one delta, waits for `go`, then drops the connection."""
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            cid = json.loads(msg.data)["id"]
            await ws.send_json({"type": "delta", "id": cid, "index": 0, "text": "Hel", "token_ids": [1]})
            await self.go.wait()
            assert request.transport is not None
            request.transport.abort()
        return ws

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(self.first)
            await self.go.wait()
            if self.die:
                assert request.transport is not None
                request.transport.abort()  # as a killed process: no terminating chunk
                return resp
            await resp.write(self.rest)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.gone.set()
            raise
        return resp


@contextlib.asynccontextmanager
async def gateway(worker: ScriptedWorker) -> AsyncIterator[str]:
    async with TestServer(worker.app(), host="127.0.0.1") as up:
        url = str(up.make_url("")).rstrip("/")
        cfg = GatewayConfig(worker_urls=(url,), policy="round_robin", health_check_interval_secs=600)
        async with TestServer(build_gateway_app(cfg), host="127.0.0.1") as gw:
            gw_url = str(gw.make_url("")).rstrip("/")
            async with aiohttp.ClientSession() as s:
                while (await (await s.get(gw_url + "/health")).json()).get("status") != "ok":
                    await asyncio.sleep(0.01)  # the first health check runs as the app starts
            yield gw_url


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
BODY = {"prompt": "x", "stream": True}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_events_go_out_as_the_worker_writes_them_and_a_split_event_goes_out_whole():
    one, two = event({"n": 1}), event({"n": 2, "text": "a longer event"})
    worker = ScriptedWorker(first=one + two[:10], rest=two[10:] + DONE)

    async def go():
        async with gateway(worker) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=BODY) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                # the first event arrives while the worker still holds the rest: nothing waits for it
                assert await r.content.readuntil(b"\n\n") == one
                worker.go.set()
                rest = await r.content.read()
        assert rest == two + DONE

    run(go())


def test_a_worker_lost_mid_event_ends_the_stream_with_an_error_event_not_a_torn_one():
    one, two = event({"n": 1}), event({"n": 2})
    worker = ScriptedWorker(first=one + two[:6], rest=b"", die=True)

    async def go():
        async with gateway(worker) as url, aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=BODY) as r:
                assert await r.content.readuntil(b"\n\n") == one
                worker.go.set()
                tail = await r.content.read()
            workers = await (await s.get(url + "/workers")).json()
        error, done = tail.split(b"\n\n", 1)
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "worker_failed"
        assert done == DONE
        assert workers["workers"][0]["healthy"] is False

    run(go())


def test_a_client_that_goes_away_closes_the_workers_connection():
    worker = ScriptedWorker(first=event({"n": 1}), rest=DONE)

    async def go():
        async with gateway(worker) as url, aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/completions", json=BODY)
            await r.content.readuntil(b"\n\n")
            r.close()
            await worker.gone.wait()
            while (await (await s.get(url + "/workers")).json())["workers"][0]["load"] != 0:
                await asyncio.sleep(0.01)  # the gateway's handler unwinds as the worker sees it go

    run(go())


def test_a_worker_socket_that_drops_ends_its_live_requests_with_errors_and_the_socket_stays_open():
    worker = ScriptedWorker(first=b"", rest=b"")

    async def go():
        async with gateway(worker) as url, aiohttp.ClientSession() as s, s.ws_connect(url + "/v1/ws") as ws:
            request = {"prompt": "x", "max_tokens": 4}
            await ws.send_json({"type": "generate", "id": "a", "endpoint": "completions", "request": request})
            assert (await ws.receive_json())["type"] == "delta"
            worker.go.set()
            final = await ws.receive_json()
            assert final["type"] == "error" and final["id"] == "a"
            assert final["error"]["code"] == "worker_failed"
            # the client's socket is still open: a new request is answered (no healthy worker is left)
            await ws.send_json({"type": "generate", "id": "b", "endpoint": "completions", "request": request})
            again = await ws.receive_json()
            assert again["id"] == "b" and again["error"]["code"] == "no_healthy_worker"
            workers = await (await s.get(url + "/workers")).json()
        assert workers["workers"][0]["healthy"] is False and workers["workers"][0]["load"] == 0

    run(go())

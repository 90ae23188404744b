"""A client that goes away aborts its engine request: mid-stream, before the first token, and for a
non-streaming request; under aiohttp's TestServer (handler cancellation on) and a plain AppRunner
(off, aiohttp's default since 3.9, where the disconnect watcher must do it)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from http_fakes import MODEL, FakeEngine, run, serve, serve_plain

from runtime.http import openai_routes


def _body(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": stream}


@contextlib.asynccontextmanager
async def _server(engine: FakeEngine, plain: bool):
    if plain:
        async with serve_plain(engine) as url:
            yield url
    else:
        async with serve(engine) as c:
            yield str(c.make_url("")).rstrip("/")


@pytest.fixture(autouse=True)
def fast_watcher(monkeypatch):
    monkeypatch.setattr(openai_routes, "DISCONNECT_POLL_S", 0.01)


@pytest.mark.parametrize("plain", [False, True], ids=["test-server", "plain-runner"])
def test_disconnect_mid_stream_aborts_the_request(engine: FakeEngine, plain: bool):
    async def go():
        async with _server(engine, plain) as url, aiohttp.ClientSession() as s:
            resp = await s.post(url + "/v1/chat/completions", json=_body("HANG AFTER ONE", True))
            assert resp.status == 200
            while b"Hel" not in await resp.content.readline():
                pass
            resp.close()
            await engine.abort_seen.wait()

    run(go())
    assert engine.aborted == [engine.requests[0].rid]


@pytest.mark.parametrize("plain", [False, True], ids=["test-server", "plain-runner"])
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_disconnect_before_the_first_token_aborts_the_request(engine: FakeEngine, plain: bool, stream: bool):
    async def go():
        async with _server(engine, plain) as url, aiohttp.ClientSession() as s:
            post = asyncio.create_task(s.post(url + "/v1/chat/completions", json=_body("HANG", stream)))
            await engine.started.wait()
            post.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await post
            await engine.abort_seen.wait()

    run(go())
    assert engine.aborted == [engine.requests[0].rid]


def test_disconnect_aborts_every_choice_of_n(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            body = {**_body("HANG AFTER ONE", True), "n": 3}
            resp = await c.post("/v1/chat/completions", json=body)
            await resp.content.readline()
            resp.close()
            while len(engine.aborted) < 3:
                engine.abort_seen.clear()
                await engine.abort_seen.wait()

    run(go())
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.requests)


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(monkeypatch):
    """Its socket buffers fill, the write waits WRITE_TIMEOUT_S, and the request is aborted."""
    import json
    import socket

    monkeypatch.setattr(openai_routes, "WRITE_TIMEOUT_S", 0.5)
    engine = FakeEngine(["x" * 65536] * 400)  # 26 MB of stream: more than any socket buffer

    async def go():
        async with _server(engine, plain=False) as url:
            host, port = url.removeprefix("http://").split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            body = json.dumps(_body("Hi", True)).encode()
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)  # then never read
            try:
                await asyncio.wait_for(engine.abort_seen.wait(), 10)
            finally:
                sock.close()

    run(go())
    assert engine.aborted

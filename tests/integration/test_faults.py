"""Faults inside the frontend and from clients, against a real server: a tokenizer that crashes, a
detokenizer that crashes mid-stream (injected with CONDUIT_FAULT_INJECT), a client that drops mid-stream,
a client that reads nothing. No client waits forever, every KV page comes back, the server serves again,
and /metrics counts what happened (engine gauges before the first request, WebSocket requests in flight,
aborts among finished requests)."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

TOKENIZER_FAULT = "KILLTOKENIZER"
DETOKENIZER_FAULT = "KILLDECODER"
TIMEOUT = aiohttp.ClientTimeout(total=180)  # every client here gets its final answer well before


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory, server_runner):
    env = {"CONDUIT_FAULT_INJECT": f"tokenizer={TOKENIZER_FAULT},detokenizer={DETOKENIZER_FAULT}"}
    with server_runner(tmp_path_factory.mktemp("faults"), env=env) as s:
        yield s


async def _stream(s: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event | None = None):
    """(HTTP status, the stream's events with [DONE] as {"done": True}) or (status, error body)."""
    async with s.post(f"{url}/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            return r.status, await r.json()
        events = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                if started is not None:
                    started.set()
        return r.status, events


def _long(i: int) -> dict:
    return {"prompt": f"Story number {i}:", "max_tokens": 3000, "ignore_eos": True}


SHORT = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def test_engine_gauges_are_there_before_the_first_request(srv):
    m = srv.metrics()
    assert m["conduit_kv_pages_used"] == 0 and m["conduit_kv_pages_total"] > 0
    assert m["conduit_num_requests_running"] == 0 and m["conduit_http_requests_in_flight"] == 0


def test_tokenizer_crash_fails_its_request_only_and_the_tokenizer_restarts(srv):
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            started = [asyncio.Event() for _ in range(3)]
            running = [
                asyncio.create_task(_stream(s, srv.url, SHORT | {"max_tokens": 24}, e)) for e in started
            ]
            await asyncio.gather(*(e.wait() for e in started))
            crashed = await _stream(s, srv.url, {"prompt": f"hello {TOKENIZER_FAULT}", "max_tokens": 4})
            after = await _stream(s, srv.url, SHORT)
            return crashed, await asyncio.gather(*running), after

    crashed, running, after = asyncio.run(main())
    assert crashed[0] == 500 and "tokenizer failed" in crashed[1]["error"]["message"]
    for status, events in running:  # they were past the tokenizer: untouched
        assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "length"
    assert after[0] == 200 and after[1][-1] == {"done": True}
    srv.wait_idle()
    assert "actor_restarted" in srv.log()


def test_detokenizer_crash_ends_every_stream_it_held_and_frees_their_kv(srv):
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            started = [asyncio.Event() for _ in range(3)]
            running = [asyncio.create_task(_stream(s, srv.url, _long(i), e)) for i, e in enumerate(started)]
            await asyncio.gather(*(e.wait() for e in started))
            crashed = await _stream(s, srv.url, {"prompt": f"say {DETOKENIZER_FAULT}", "max_tokens": 50})
            return crashed, await asyncio.gather(*running)

    crashed, running = asyncio.run(main())
    for status, events in [*running]:
        assert status == 200 and events[-1] == {"done": True}
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and "detokenizer failed" in errors[0]["error"]["message"]
    # the faulty request failed before its first token was sent: a plain 500
    assert crashed[0] == 500 and "detokenizer failed" in crashed[1]["error"]["message"]
    srv.wait_idle()  # their aborts reached the scheduler: all KV back although they asked for 3000 tokens
    assert asyncio.run(_once(srv.url, SHORT))[0] == 200


async def _once(url: str, body: dict):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        return await _stream(s, url, body)


def test_dropped_and_stalled_clients_free_their_kv_and_do_not_stall_others(srv):
    before = srv.metrics().get('conduit_request_finished_total{finish_reason="abort"}', 0)
    host, port = srv.url.removeprefix("http://").split(":")
    # a client that sends a streaming request and never reads a byte of the answer
    stalled = socket.create_connection((host, int(port)))
    body = json.dumps({"prompt": "Stall", "max_tokens": 60, "ignore_eos": True, "stream": True}).encode()
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:

        async def main():
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                # a client that drops mid-stream
                async with s.post(f"{srv.url}/v1/completions", json=_long(9) | {"stream": True}) as r:
                    n = 0
                    async for _ in r.content:
                        n += 1
                        if n > 3:
                            break
                # others are served meanwhile
                return await asyncio.gather(*(_stream(s, srv.url, SHORT) for _ in range(3)))

        for status, events in asyncio.run(main()):
            assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "length"
        # the stalled request ends in the engine (its answer fits the socket buffers): all KV back
        srv.wait_idle(timeout=180)
    finally:
        stalled.close()
    after = srv.metrics()['conduit_request_finished_total{finish_reason="abort"}']
    assert after >= before + 1


def test_websocket_requests_count_in_flight_and_aborts_count_as_finished(srv):
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.ws_connect(f"{srv.url}/v1/ws") as ws:
            request = {"type": "generate", "id": "a", "endpoint": "completions", "request": _long(1)}
            await ws.send_json(request)
            assert (await ws.receive_json(timeout=60))["type"] == "delta"
            live = srv.metrics()["conduit_http_requests_in_flight"]
            await ws.send_json({"type": "abort", "id": "a"})
            while (msg := await ws.receive_json(timeout=60))["type"] == "delta":
                pass
            return live, msg

    before = srv.metrics().get('conduit_request_finished_total{finish_reason="abort"}', 0)
    live, final = asyncio.run(main())
    assert live == 1 and final["type"] == "done" and final["finish_reason"] == "abort"
    m = srv.wait_idle()
    assert m["conduit_http_requests_in_flight"] == 0
    assert m['conduit_request_finished_total{finish_reason="abort"}'] == before + 1

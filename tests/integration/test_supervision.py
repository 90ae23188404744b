"""If the engine process dies, every in-flight request still gets exactly one final (error) message,
/health turns 503 and new requests are refused with 503 and Retry-After instead of hanging; then the
actor system restarts the engine and the server serves again, with the same answers, without an operator."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import psutil

GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def _engine(server) -> psutil.Process:
    (engine,) = [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "runtime.actors.engine_process" in " ".join(p.cmdline())
    ]
    return engine


async def _stream_until_killed(url: str, engine_pid: int) -> list[dict]:
    body = {"prompt": "Count forever:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    events.append({"done": True})
                    break
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.kill(engine_pid, signal.SIGKILL)
    return events


async def _health_and_refusal(url: str) -> tuple[int, int, str | None]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/health") as h:
            health = h.status
        async with s.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert (await r.json())["error"]["message"]
            return health, r.status, r.headers.get("Retry-After")


async def _health(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as h:
        return h.status


async def _complete(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=GREEDY) as r:
            return r.status, await r.json()


def test_engine_death_fails_in_flight_requests_then_the_engine_is_restarted(launch_server):
    with launch_server() as server:
        status, before = asyncio.run(_complete(server.url))
        assert status == 200
        engine = _engine(server)
        events = asyncio.run(_stream_until_killed(server.url, engine.pid))
        assert events[-1] == {"done": True}
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and "engine" in errors[0]["error"]["message"]
        # the restart waits a back-off and loads the model: until then, 503s that say when to retry
        health, refused, retry_after = asyncio.run(_health_and_refusal(server.url))
        assert (health, refused) == (503, 503) and int(retry_after) >= 1

        deadline = time.monotonic() + 240
        while asyncio.run(_health(server.url)) != 200:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)  # polling the server's health; there is no event to wait on
        restarted = _engine(server)
        assert restarted.pid != engine.pid and not engine.is_running()
        status, after = asyncio.run(_complete(server.url))
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
        server.wait_idle()
        log = server.log()
        assert "node_restarting" in log and "engine_recovered" in log

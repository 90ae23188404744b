"""If the engine process dies, every in-flight request still gets exactly one final (error) message,
/health turns 503, and new requests are refused with 503 instead of hanging."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import psutil


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


def test_engine_death_fails_in_flight_requests_and_health(launch_server):
    with launch_server() as server:
        engine = [
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "runtime.actors.engine_process" in " ".join(p.cmdline())
        ]
        assert len(engine) == 1
        events = asyncio.run(_stream_until_killed(server.url, engine[0].pid))
        assert events[-1] == {"done": True}
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and "engine" in errors[0]["error"]["message"]

        async def after() -> tuple[int, int]:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{server.url}/health") as h:
                    health = h.status
                async with s.post(
                    f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
                ) as r:
                    body = await r.json()
                    assert body["error"]["message"]
                    return health, r.status

        assert asyncio.run(after()) == (503, 503)

"""One rank of a two-rank engine dies mid-stream, under tensor parallelism (SmolLM2) and under DP
attention with expert parallelism (tiny DeepSeek-V3, ranks in lockstep): every in-flight request ends
with one clear error, /health turns 503, the surviving rank is stopped (its collectives would wait
forever) and nothing is restarted alone; Ctrl-C then stops the server promptly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import psutil
import pytest

from runtime.gpu.testing import copy_tokenizer, save_tiny_deepseek_v3

SMALL = ("--cpu-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8")
DEP = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2")


def _ranks(server) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "runtime.actors.engine_process" in " ".join(p.cmdline())
    ]


async def _stream(s: aiohttp.ClientSession, url: str, started: asyncio.Event) -> list[dict]:
    # long enough to outlast the kill, short enough that admission (which keeps 70% of each request's
    # max_tokens free for it) starts both streams at once in the 4096-token pool
    body = {"prompt": "Count forever:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    events = []
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
                started.set()
    return events


async def _kill_mid_stream(url: str, victim: int) -> list[list[dict]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(_stream(s, url, e)) for e in started]
        await asyncio.gather(*(e.wait() for e in started))
        os.kill(victim, signal.SIGKILL)
        return await asyncio.gather(*streams)


async def _health(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as h:
        return h.status


@pytest.fixture(params=["tp", "dep"])
def flags(request, smollm2_path, tmp_path_factory) -> tuple[str, ...]:
    if request.param == "tp":
        return ("--tp-size", "2", *SMALL)
    path = tmp_path_factory.mktemp("tiny-v3")
    save_tiny_deepseek_v3(path, seed=11, vocab_size=49152, max_position_embeddings=8192)
    copy_tokenizer(smollm2_path, path)
    return ("--model", str(path), *DEP, *SMALL)


def test_a_rank_death_fails_each_request_once_and_stops_every_rank(launch_server, flags):
    with launch_server(*flags) as server:
        ranks = _ranks(server)
        assert len(ranks) == 2
        victim = max(ranks, key=lambda p: p.pid)
        results = asyncio.run(_kill_mid_stream(server.url, victim.pid))
        for events in results:
            assert events[-1] == {"done": True}
            errors = [e for e in events if "error" in e]
            assert len(errors) == 1, events[-4:]
            message = errors[0]["error"]["message"]
            # the frontend's word on the dead process, or the survivor's on its broken collective
            assert message.startswith("engine failed: engine/") or "another rank may have died" in message
            assert len(message) < 400
        assert asyncio.run(_health(server.url)) == 503
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks still running: {alive}"
        assert "stopping_node" in server.log() and "node_restarting" not in server.log()
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30 and server.proc.returncode is not None

"""32 concurrent streams each produce what they produce alone; aborts and disconnects free their KV."""

from __future__ import annotations

import asyncio
import json

import aiohttp

PROMPTS = [f"Write a sentence about the number {i}." for i in range(32)]


async def stream_chat(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> str:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text)


async def disconnect_midway(session: aiohttp.ClientSession, url: str) -> None:
    body = {"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        n = 0
        async for _ in r.content:
            n += 1
            if n > 4:
                break  # leaving the block closes the connection mid-stream


def test_concurrent_streams_equal_their_solo_runs_and_kv_returns_to_zero(server):
    async def main():
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            solo = [await stream_chat(s, server.url, p, 24) for p in PROMPTS[:8]]
            together = await asyncio.gather(*(stream_chat(s, server.url, p, 24) for p in PROMPTS))
            assert together[:8] == solo
            assert all(t for t in together)
            # disconnects mid-stream, then a completed request: nothing stays allocated
            await asyncio.gather(*(disconnect_midway(s, server.url) for _ in range(4)))
            await asyncio.to_thread(server.wait_idle)
            assert await stream_chat(s, server.url, PROMPTS[0], 24) == solo[0]
            await asyncio.to_thread(server.wait_idle)

    asyncio.run(main())

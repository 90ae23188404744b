"""An aiohttp WebSocket client multiplexes requests on one socket and aborts one by id."""

from __future__ import annotations

import asyncio

import aiohttp


async def _run(url: str) -> dict[str, list[dict]]:
    frames: dict[str, list[dict]] = {"a": [], "b": [], "c": []}
    async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}/v1/ws") as ws:
        await ws.send_json(
            {
                "type": "generate",
                "id": "a",
                "endpoint": "chat",
                "request": {
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 16,
                    "temperature": 0,
                },
            }
        )
        await ws.send_json(
            {
                "type": "generate",
                "id": "b",
                "endpoint": "completions",
                "request": {"prompt": "One, two, three,", "max_tokens": 12, "temperature": 0},
            }
        )
        await ws.send_json(
            {
                "type": "generate",
                "id": "c",
                "endpoint": "completions",
                "request": {
                    "prompt": "A long story:",
                    "max_tokens": 2000,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
        finals = 0
        while finals < 3:
            msg = await asyncio.wait_for(ws.receive_json(), 120)
            frames[msg["id"]].append(msg)
            if msg["id"] == "c" and msg["type"] == "delta" and len(frames["c"]) == 3:
                await ws.send_json({"type": "abort", "id": "c"})
            if msg["type"] in ("done", "error"):
                finals += 1
    return frames


def test_two_requests_at_once_and_an_abort_on_one_socket(server):
    frames = asyncio.run(_run(server.url))
    for rid in "abc":
        finals = [f for f in frames[rid] if f["type"] in ("done", "error")]
        assert len(finals) == 1 and frames[rid][-1] is finals[0], rid
    assert "Paris" in "".join(f.get("text", "") for f in frames["a"])
    assert frames["b"][-1]["finish_reason"] == "length"
    assert frames["b"][-1]["usage"]["completion_tokens"] == 12
    assert frames["c"][-1]["finish_reason"] == "abort"
    assert frames["c"][-1]["usage"]["completion_tokens"] < 2000

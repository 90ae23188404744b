"""A small OpenAI-compatible SSE server for loadgen tests, run on its own thread and event loop.

It streams `max_tokens` one-word chunks (a short pause between them) and a final usage chunk, and
records the most requests it ever had in flight."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import WSMsgType, web


class FakeServer:
    def __init__(self, mode: str = "ok", chunk_delay: float = 0.002):
        self.mode = mode  # "ok" | "500" | "badjson"
        self.chunk_delay = chunk_delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.completion_tokens = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_get("/v1/ws", self.ws)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def _enter(self) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.mode == "500":
            return web.json_response(
                {"error": {"message": "engine failed", "type": "server_error"}}, status=500
            )
        self._enter()
        try:
            chat = "messages" in body
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(self.chunk_delay)
                if self.mode == "badjson" and i == 1:
                    await resp.write(b"data: {not json\n\n")
                    return resp
                choice = (
                    {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                )
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            self.completion_tokens += n
            return resp
        finally:
            self.in_flight -= 1

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        """Requests multiplexed by id: each generate message is answered by its own task."""
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        tasks = set()
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            d = json.loads(msg.data)
            if d["type"] == "generate":
                t = asyncio.create_task(self._ws_generate(ws, d))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        return ws

    async def _ws_generate(self, ws: web.WebSocketResponse, d: dict) -> None:
        self._enter()
        try:
            if self.mode == "500":
                await ws.send_json({"type": "error", "id": d["id"], "message": "engine failed"})
                return
            n = d["request"]["max_tokens"]
            for i in range(n):
                await asyncio.sleep(self.chunk_delay)
                await ws.send_json({"type": "delta", "id": d["id"], "text": f" w{i}"})
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
            await ws.send_json({"type": "done", "id": d["id"], "usage": usage})
            self.completion_tokens += n
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server(request):
    server = FakeServer(**getattr(request, "param", {})).start()
    try:
        yield server
    finally:
        server.stop()

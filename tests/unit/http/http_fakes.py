"""A scripted fake EngineClient and helpers to serve the HTTP app on loopback for one test.

No pytest-asyncio here: each test is a plain function that runs its own coroutine with `run`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from runtime.errors import EngineFailed, InvalidRequest
from runtime.http.app import build_app
from runtime.http.options import ServingOptions
from runtime.mailbox.messages import EngineStats, GenerateRequest, TextDelta, TokenLogprobs

MODEL = "test-model"
PIECES = ["Hel", "lo", " world"]


class FakeEngine:
    """Yields `pieces` as deltas (one token each). Special prompts script failures:
    "TOO LONG" -> InvalidRequest before any delta; "FAIL MID" -> EngineFailed after one delta;
    "HANG" -> never yields; "HANG AFTER ONE" -> one delta, then waits forever."""

    model_name = MODEL
    max_model_len = 4096

    def __init__(self, pieces: list[str] | None = None) -> None:
        self.pieces = pieces or PIECES
        self.stats: EngineStats | None = EngineStats(
            running=2, waiting=1, kv_pages_used=10, kv_pages_total=100
        )
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.started = asyncio.Event()
        self.abort_seen = asyncio.Event()
        self.flushed = 0
        self.busy = False  # flush_cache refuses (requests running)

    @property
    def healthy(self) -> bool:
        return self.stats is None or self.stats.healthy

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TextDelta]:
        self.requests.append(req)
        self.started.set()
        text = req.prompt or (req.messages[-1].content if req.messages else "")
        if "TOO LONG" in text:
            raise InvalidRequest("The prompt is longer than the context.", param="messages")
        finished = False
        try:
            if text.startswith("HANG") and text != "HANG AFTER ONE":
                await asyncio.Event().wait()
            for k, piece in enumerate(self.pieces):
                await asyncio.sleep(0)
                last = k == len(self.pieces) - 1
                finished = last
                yield self._delta(req, k, piece, "stop" if last else None)
                if text == "FAIL MID":
                    raise EngineFailed("gpu worker crashed")
                if text == "HANG AFTER ONE":
                    await asyncio.Event().wait()
        finally:
            if not finished:
                self.aborted.append(req.rid)
                self.abort_seen.set()

    def _delta(self, req: GenerateRequest, k: int, piece: str, finish: str | None) -> TextDelta:
        lps = tokens_text = None
        if req.params.logprobs is not None:
            top_ids = [100 + k, 7][: req.params.logprobs]
            lps = [TokenLogprobs(100 + k, -0.5, top_ids, [-0.5, -2.0][: len(top_ids)])]
            tokens_text = [piece]
        return TextDelta(
            rid=req.rid,
            text=piece,
            token_ids=[100 + k],
            finish_reason=finish,
            prompt_tokens=5,
            completion_tokens=k + 1,
            cached_tokens=2,
            logprobs=lps,
            tokens_text=tokens_text,
        )

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    async def flush_cache(self) -> bool:
        self.flushed += 1
        return not self.busy


@asynccontextmanager
async def serve(engine: FakeEngine, options: ServingOptions | None = None) -> AsyncIterator[TestClient]:
    """The app on a loopback TestServer (which cancels handlers on disconnect)."""
    app = build_app(engine, served_model=MODEL, options=options)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@asynccontextmanager
async def serve_plain(engine: FakeEngine) -> AsyncIterator[str]:
    """The app under a plain AppRunner, as `conduit serve` may run it (no handler cancellation)."""
    runner = web.AppRunner(build_app(engine, served_model=MODEL))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def base_url(client: TestClient) -> str:
    return str(client.make_url("/v1"))


def run(coro) -> object:
    return asyncio.run(asyncio.wait_for(coro, 10))

"""The engine client: the actor at the edge of the engine. The HTTP server and the offline `Engine` submit
requests through it and read each request's deltas from a per-request queue. It guarantees every
accepted request ends with exactly one final message: a finished delta, or an exception."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator

import structlog

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.errors import ConduitError, EngineFailed, Overloaded, error_from_status
from runtime.mailbox.messages import (
    AbortRequest,
    CacheFlushed,
    EngineStats,
    FlushCache,
    GenerateRequest,
    Message,
    NodeFailed,
    RequestFailed,
    TextDelta,
    TextDeltas,
)

log = structlog.get_logger(__name__)

_ids = itertools.count()


class EngineClient(Actor):
    mailbox_size = 65536

    def __init__(self, model_name: str, max_model_len: int, scheduler: str = addresses.scheduler(0)) -> None:
        super().__init__(addresses.CLIENT)
        self.scheduler = scheduler  # where cache flushes go
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.stats: EngineStats | None = None
        self.error: str | None = None
        self._streams: dict[str, asyncio.Queue[TextDelta | ConduitError]] = {}
        self._flushes: dict[int, asyncio.Future[bool]] = {}

    @property
    def healthy(self) -> bool:
        return self.error is None and (self.stats is None or self.stats.healthy)

    @staticmethod
    def new_rid(prefix: str = "req") -> str:
        return f"{prefix}-{os.getpid():x}{next(_ids):08x}"

    # ------------------------------------------------------------------ the API

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TextDelta]:
        """Yield the request's deltas, the last one with `finish_reason` set; raise ConduitError if it
        fails. Closing the iterator early (or cancelling its task) aborts the request in the engine."""
        if not self.healthy:
            raise Overloaded(
                f"engine is unhealthy: {self.error or (self.stats and self.stats.error)}",
                status=503,
                retry_after=5.0,
            )
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid} is already running")
        queue: asyncio.Queue[TextDelta | ConduitError] = asyncio.Queue()
        self._streams[req.rid] = queue
        finished = False
        try:
            if not req.arrival:
                import msgspec

                req = msgspec.structs.replace(req, arrival=time.time())
            await self.send(addresses.TOKENIZER, req)
            while True:
                item = await queue.get()
                if isinstance(item, ConduitError):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(req.rid, None)
            if not finished:
                await self.abort(req.rid)

    async def abort(self, rid: str) -> None:
        await self.send(addresses.TOKENIZER, AbortRequest(rid))

    async def flush_cache(self, timeout: float = 30.0) -> bool:
        """Drop the scheduler's cached prefixes. False when it refused (requests running or waiting) or
        did not answer within `timeout` seconds. Once this returns, EngineStats (and /metrics) show the
        cache after the flush."""
        flush_id = next(_ids)
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._flushes[flush_id] = answer
        try:
            await self.send(self.scheduler, FlushCache(flush_id))
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            return False
        finally:
            self._flushes.pop(flush_id, None)

    # ------------------------------------------------------------------ inbound

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, TextDeltas):
            for item in msg.items:
                q = self._streams.get(item.rid)
                if q is not None:
                    q.put_nowait(item)
        elif isinstance(msg, RequestFailed):
            q = self._streams.get(msg.rid)
            if q is not None:
                q.put_nowait(
                    error_from_status(
                        msg.status, msg.message, type=msg.error_type, param=msg.param, code=msg.code
                    )
                )
        elif isinstance(msg, EngineStats):
            self.stats = msg
        elif isinstance(msg, CacheFlushed):
            answer = self._flushes.get(msg.id)
            if answer is not None and not answer.done():
                answer.set_result(msg.ok)
        elif isinstance(msg, NodeFailed):
            self.fail_all(f"{msg.node}: {msg.error}")

    def fail_all(self, error: str) -> None:
        """The engine is gone: every waiting request gets its final error now, and the client refuses new
        ones (503, /health too) until `engine_ready`."""
        self.error = error
        self.stats = None  # the dead engine's gauges; a restarted engine reports its own
        log.error("engine_failed", error=error, in_flight=len(self._streams))
        for q in self._streams.values():
            q.put_nowait(EngineFailed(f"engine failed: {error}"))

    def engine_ready(self, node: str) -> None:
        """A restarted engine reported in: serve again."""
        if self.error is not None:
            log.info("engine_recovered", node=node, after=self.error)
        self.error = None

    def cancel_all(self, message: str) -> int:
        """End every request in flight with a 503 `message` (shutdown past its deadline); the handlers'
        streams then abort them in the engine. Returns how many there were."""
        for q in self._streams.values():
            err = Overloaded(message, status=503, retry_after=5.0, code="shutting_down")
            err.type = "server_error"
            q.put_nowait(err)
        return len(self._streams)

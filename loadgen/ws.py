"""Conduit's WebSocket protocol on shared sockets: many requests multiplexed by id.

Client -> server: {"type": "generate", "id", "endpoint", "request"} and {"type": "abort", "id"}.
Server -> client: {"type": "delta", "id", "text"}, then {"type": "done", "id", "usage"} or
{"type": "error", "id", "message"}."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import msgspec

CLOSED = {"type": "error", "message": "websocket closed before 'done'"}


class _Conn:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.pending: dict[str, asyncio.Queue] = {}
        self.reader = asyncio.create_task(self._read())

    @property
    def alive(self) -> bool:
        return not self.ws.closed and not self.reader.done()

    async def _read(self) -> None:
        """Route each message to its request's queue; on close or bad JSON, fail every pending one."""
        end = CLOSED
        async for m in self.ws:
            if m.type != aiohttp.WSMsgType.TEXT:
                break
            try:
                d = msgspec.json.decode(m.data)
            except msgspec.DecodeError:
                end = {"type": "error", "message": f"bad JSON from websocket: {m.data[:80]!r}"}
                break
            q = self.pending.get(d.get("id")) if isinstance(d, dict) else None
            if q is not None:
                q.put_nowait(d)
            elif isinstance(d, dict) and d.get("type") == "error" and d.get("id") is None:
                end = d  # a connection-level error
                break
        for q in self.pending.values():
            q.put_nowait(end)
        await self.ws.close()


class WSPool:
    """`n` sockets to base_url + /v1/ws, opened on first use (and reopened if one drops);
    requests are spread over them round-robin."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, n: int = 1, timeout: float = 600.0):
        self.session, self.url, self.timeout = session, base_url + "/v1/ws", timeout
        self.conns: list[_Conn | None] = [None] * max(n, 1)
        self.locks = [asyncio.Lock() for _ in self.conns]
        self.turn = 0

    async def _conn(self) -> _Conn:
        i = self.turn % len(self.conns)
        self.turn += 1
        async with self.locks[i]:
            c = self.conns[i]
            if c is None or not c.alive:
                ws = await self.session.ws_connect(self.url, max_msg_size=0, autoping=True)
                c = self.conns[i] = _Conn(ws)
            return c

    async def stream(self, rid: str, msg: dict) -> AsyncIterator[dict]:
        """Send one generate message; yield this request's messages until done or error."""
        c = await self._conn()
        q: asyncio.Queue = asyncio.Queue()
        c.pending[rid] = q
        try:
            await c.ws.send_str(msgspec.json.encode(msg).decode())
            while True:
                try:
                    d = await asyncio.wait_for(q.get(), self.timeout)
                except TimeoutError:
                    if not c.ws.closed:
                        await c.ws.send_str(msgspec.json.encode({"type": "abort", "id": rid}).decode())
                    raise
                yield d
                if d.get("type") in ("done", "error"):
                    return
        finally:
            c.pending.pop(rid, None)

    async def close(self) -> None:
        for c in self.conns:
            if c is not None:
                await c.ws.close()
                c.reader.cancel()

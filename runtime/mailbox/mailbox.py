"""A bounded FIFO mailbox: the only way messages reach an actor in its own process."""

from __future__ import annotations

import asyncio

from runtime.mailbox.messages import Message


class Mailbox:
    """Bounded so a slow actor pushes back on its senders instead of growing without limit."""

    def __init__(self, maxsize: int = 4096) -> None:
        self._queue: asyncio.Queue[Message] = asyncio.Queue(maxsize)

    async def put(self, msg: Message) -> None:
        await self._queue.put(msg)

    def put_nowait(self, msg: Message) -> None:
        """For callers outside the event loop's coroutines (e.g. a disconnect callback); raises
        asyncio.QueueFull when the actor is overloaded, which the caller must treat as backpressure."""
        self._queue.put_nowait(msg)

    async def get(self) -> Message:
        return await self._queue.get()

    def qsize(self) -> int:
        return self._queue.qsize()

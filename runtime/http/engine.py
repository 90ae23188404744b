"""What the HTTP layer needs from the engine: the `EngineClient` interface, as a structural type.

The real client lives in `runtime/actors/client.py`; tests pass a fake. HTTP never imports torch or
the actors, only this interface and the protocol messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from runtime.mailbox.messages import EngineStats, GenerateRequest, TextDelta


class Engine(Protocol):
    model_name: str
    max_model_len: int
    stats: EngineStats | None

    @property
    def healthy(self) -> bool: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TextDelta]:
        """Deltas of `req.rid` up to and including the one with `finish_reason` set; raises a
        `ConduitError` if the request fails. Closing the iterator early aborts the request."""
        ...

    async def abort(self, rid: str) -> None: ...

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False when the engine refused (requests running or waiting)."""
        ...

"""The actor base class: private state, one message at a time, a bounded mailbox."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import structlog

from runtime.mailbox.mailbox import Mailbox
from runtime.mailbox.messages import Message, RequestFailed

if TYPE_CHECKING:
    from runtime.actors.system import ActorSystem

log = structlog.get_logger(__name__)


class Actor:
    """Subclasses set `name` and implement `handle`. `handle` must not block the event loop: long CPU or
    GPU work goes to a thread (see GpuWorker)."""

    name: ClassVar[str]
    mailbox_size: ClassVar[int] = 4096

    def __init__(self) -> None:
        self.mailbox = Mailbox(self.mailbox_size)
        self.system: ActorSystem | None = None

    async def on_start(self) -> None:
        """Called once before the first message (load models, open files)."""

    async def on_stop(self) -> None:
        """Called once after the last message."""

    async def handle(self, msg: Message) -> None:
        raise NotImplementedError

    async def send(self, to: str, msg: Message) -> None:
        assert self.system is not None, f"{self.name} is not spawned"
        await self.system.send(to, msg)

    async def on_error(self, msg: Message, exc: BaseException) -> None:
        """Supervision for one failed message: the actor keeps running (its state is its own to repair),
        and a request the message belonged to gets its final error message instead of hanging."""
        log.exception("actor_failed_message", actor=self.name, msg=type(msg).__name__)
        rid = getattr(msg, "rid", None)
        if rid is not None:
            await self.send(
                "client",
                RequestFailed(
                    rid=rid, status=500, message=f"{self.name} failed: {exc}", error_type="server_error"
                ),
            )

"""The actor base class: private state, one message at a time, a bounded mailbox."""

from __future__ import annotations

from typing import ClassVar, Protocol

import structlog

from runtime.actors import addresses
from runtime.mailbox.mailbox import Mailbox
from runtime.mailbox.messages import Message, RequestFailed

log = structlog.get_logger(__name__)


class Router(Protocol):
    """What an actor needs of the system that runs it: delivery to an address (runtime/actors/system.py)."""

    async def send(self, to: str, msg: Message) -> None: ...


class Actor:
    """Subclasses pass their address (runtime/actors/addresses.py) and implement `handle`. `handle` must
    not block the event loop: long CPU or GPU work goes to a thread (see GpuWorker)."""

    mailbox_size: ClassVar[int] = 4096
    # True: an exception from `handle` is a crash. The system calls `on_crash` (fail what the actor held)
    # and replaces it with `fresh()`, which keeps its mailbox. False: `on_error` fails that message only.
    restart_on_crash: ClassVar[bool] = False

    def __init__(self, address: str) -> None:
        self.address = address
        self.mailbox = Mailbox(self.mailbox_size)
        self.system: Router | None = None

    async def on_start(self) -> None:
        """Called once before the first message (load models, open files)."""

    async def on_stop(self) -> None:
        """Called once after the last message."""

    async def handle(self, msg: Message) -> None:
        raise NotImplementedError

    async def send(self, to: str, msg: Message) -> None:
        assert self.system is not None, f"{self.address} is not spawned"
        await self.system.send(to, msg)

    async def on_crash(self, msg: Message, exc: BaseException) -> None:
        """`handle` raised and this instance is about to be replaced: end every request it holds."""

    def fresh(self) -> Actor:
        """A new instance for the same address, with empty state (restart after a crash)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restarted")

    async def fail(self, rids, message: str) -> None:
        """Send each request's final error (a 500) to the client."""
        for rid in rids:
            await self.send(
                addresses.CLIENT,
                RequestFailed(rid=rid, status=500, message=message, error_type="server_error"),
            )

    async def on_error(self, msg: Message, exc: BaseException) -> None:
        """Supervision for one failed message: the actor keeps running (its state is its own to repair),
        and a request the message belonged to gets its final error message instead of hanging."""
        log.exception("actor_failed_message", actor=self.address, msg=type(msg).__name__)
        rid = getattr(msg, "rid", None)
        if rid is not None:
            await self.send(
                addresses.CLIENT,
                RequestFailed(
                    rid=rid, status=500, message=f"{self.address} failed: {exc}", error_type="server_error"
                ),
            )

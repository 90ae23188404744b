"""The KV transfer backend contract, its registry, and the two ends every backend shares: `KVSender`
(prefill side: a pool of links per decode address) and `KVReceiver` (decode side: the listener).

A backend moves the tensors of one request over a `Link`, the control connection both ends hold
(`protocol.py`), in three duties on each side:

    sender   `connect(link) -> info` (before Hello), `connected(link, info)` (HelloAck's info),
             `stage(link, tensors) -> info` (before the header), `push(link, tensors)` (after it),
             `finish(link, info)` (after the ack, whatever it said)
    receiver `accept(link, info) -> info` (a Hello arrived), `pull(link, header) -> Received`

Adding a backend is a new module with a subclass and one line in `BACKENDS`."""

from __future__ import annotations

import asyncio
import importlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import torch

from runtime.disaggregation.protocol import (
    Hello,
    HelloAck,
    KVAck,
    KVHeader,
    TensorMeta,
    read_frame,
    split_address,
    write_frame,
)

log = structlog.get_logger(__name__)

BACKENDS = {
    "tcp": "runtime.disaggregation.tcp:TcpBackend",
    "shm": "runtime.disaggregation.shm:ShmBackend",
    "nccl": "runtime.disaggregation.nccl:NcclBackend",
    "nixl": "runtime.disaggregation.nixl:NixlBackend",
    "mooncake": "runtime.disaggregation.mooncake:MooncakeBackend",
}

_link_ids = itertools.count(1)


class TransferError(Exception):
    """A transfer failed (the peer went away, refused it, or it timed out)."""


@dataclass(eq=False)
class Link:
    """One control connection and what the backend keeps for it (a process group, a shm handle...)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    id: int = field(default_factory=lambda: next(_link_ids))
    state: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        self.writer.close()


@dataclass
class Received:
    """Tensors pulled by the receiver (possibly views of the backend's buffers: use them, then close)."""

    tensors: dict[str, torch.Tensor]
    close: Callable[[], None] = lambda: None


class TransferBackend(ABC):
    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ------------------------------------------------------------------ set-up of a link
    async def connect(self, link: Link) -> dict[str, Any]:
        return {}

    async def connected(self, link: Link, info: dict[str, Any]) -> None:
        return

    async def accept(self, link: Link, info: dict[str, Any]) -> dict[str, Any]:
        return {}

    def close(self, link: Link) -> None:
        link.close()

    # ------------------------------------------------------------------ one request
    async def stage(self, link: Link, tensors: list[torch.Tensor]) -> dict[str, Any]:
        return {}

    @abstractmethod
    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None: ...

    @abstractmethod
    async def pull(self, link: Link, header: KVHeader) -> Received: ...

    def finish(self, link: Link, info: dict[str, Any]) -> None:
        return


def make_backend(name: str, device: torch.device | str = "cpu") -> TransferBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(torch.device(device))


def host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes on the host (one device-to-host copy on a GPU)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


@dataclass
class FirstToken:
    token: int
    logprob: float | None = None
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class KVSender:
    """Prefill side: sends one request's KV to a decode address; links are pooled per address (one
    transfer at a time per link; concurrent transfers open more links)."""

    def __init__(self, backend: TransferBackend, timeout: float) -> None:
        self.backend = backend
        self.timeout = timeout
        self._idle: dict[str, list[Link]] = {}
        self._sessions: dict[int, Link] = {}  # room -> the link its next chunk goes over

    async def _open(self, address: str) -> Link:
        host, port = split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        link = Link(reader, writer)
        try:
            await write_frame(writer, Hello(self.backend.name, await self.backend.connect(link)))
            ack = await read_frame(reader)
            if not isinstance(ack, HelloAck) or ack.error:
                raise TransferError(f"the decode server refused the link: {getattr(ack, 'error', ack)}")
            await self.backend.connected(link, ack.info)
        except BaseException:
            self.backend.close(link)
            raise
        return link

    async def send(
        self,
        address: str,
        room: int,
        kv: dict[str, torch.Tensor],
        first: FirstToken | None = None,
        *,
        start: int = 0,
        final: bool = True,
    ) -> None:
        """Move `kv` (positions from `start`) to the decode server at `address` for transfer `room`; a
        request's chunks go over one link, in call order, the `final` one with the first token. Raises
        TransferError."""
        try:
            await asyncio.wait_for(self._send(address, room, kv, first, start, final), self.timeout)
        except TimeoutError:
            raise TransferError(f"KV transfer to {address} timed out after {self.timeout:g}s") from None
        except (OSError, asyncio.IncompleteReadError) as e:
            raise TransferError(f"KV transfer to {address} failed: {type(e).__name__}: {e}") from None

    async def _send(
        self,
        address: str,
        room: int,
        kv: dict[str, torch.Tensor],
        first: FirstToken | None,
        start: int,
        final: bool,
    ) -> None:
        idle = self._idle.setdefault(address, [])
        link = self._sessions.pop(room, None)
        if link is None:
            link = idle.pop() if idle else await self._open(address)
        first = first or FirstToken(-1)
        names = sorted(kv)
        tensors = [kv[n] for n in names]
        info: dict[str, Any] = {}
        ok = False
        try:
            info = await self.backend.stage(link, tensors)
            header = KVHeader(
                room=room, start=start, final=final, token=first.token, logprob=first.logprob,
                top_ids=first.top_ids, top_logprobs=first.top_logprobs,
                tensors=[TensorMeta.of(n, kv[n]) for n in names], info=info,
            )  # fmt: skip
            await write_frame(link.writer, header)
            await self.backend.push(link, tensors)
            ack = await read_frame(link.reader)
            ok = True
        finally:
            self.backend.finish(link, info)
            if not ok:  # the link's state is unknown after a failure: never reuse it
                self.backend.close(link)
            elif final:
                idle.append(link)
            else:  # the request's next chunk follows on this link
                self._sessions[room] = link
        if not isinstance(ack, KVAck) or ack.room != room:
            raise TransferError(f"unexpected answer from the decode server: {ack}")
        if ack.error:
            raise TransferError(f"the decode server refused the KV: {ack.error}")

    def drop(self, room: int) -> None:
        """Forget a request whose chunks stopped (its link closes)."""
        link = self._sessions.pop(room, None)
        if link is not None:
            self.backend.close(link)

    def close(self) -> None:
        for links in [*self._idle.values(), list(self._sessions.values())]:
            for link in links:
                self.backend.close(link)
        self._idle.clear()
        self._sessions.clear()


# the decode side's handler of one arrived request: returns an error message, or None when imported
OnKV = Callable[[KVHeader, Received], Awaitable[str | None]]


class KVReceiver:
    """Decode side: listens on `address` for prefill links and hands each request's KV to `on_kv`."""

    def __init__(self, backend: TransferBackend, on_kv: OnKV) -> None:
        self.backend = backend
        self.on_kv = on_kv
        self._server: asyncio.AbstractServer | None = None
        self._links: set[Link] = set()

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer)
        self._links.add(link)
        try:
            hello = await read_frame(reader)
            if not isinstance(hello, Hello) or hello.backend != self.backend.name:
                got = getattr(hello, "backend", type(hello).__name__)
                await write_frame(writer, HelloAck(f"this decode server uses {self.backend.name}, not {got}"))
                return
            await write_frame(writer, HelloAck(None, await self.backend.accept(link, hello.info)))
            while True:
                header = await read_frame(reader)
                if not isinstance(header, KVHeader):
                    raise TransferError(f"expected a KV header, got {type(header).__name__}")
                received = await self.backend.pull(link, header)
                try:
                    error = await self.on_kv(header, received)
                finally:
                    received.close()
                await write_frame(writer, KVAck(header.room, error))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the prefill side went away (or we stop); a transfer it did not finish times out here
        except Exception as e:
            log.warning("kv_link_failed", link=link.id, error=f"{type(e).__name__}: {e}")
        finally:
            self._links.discard(link)
            self.backend.close(link)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            self.backend.close(link)

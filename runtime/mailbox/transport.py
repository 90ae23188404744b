"""Cross-process delivery: length-prefixed msgpack frames of `Envelope` over Unix-domain sockets on one
host, and over TCP between hosts (`tcp://HOST:PORT` addresses: engines of several nodes).

One connection per (sender process, receiver process) pair and writes in call order, so delivery is
FIFO per sender, as it is for in-process mailboxes. Nothing but the connect and listen calls depends on
the socket family.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import structlog

from runtime.mailbox.messages import Envelope

log = structlog.get_logger(__name__)

_HEADER = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(env: Envelope) -> bytes:
    payload = _encoder.encode(env)
    return _HEADER.pack(len(payload)) + payload


async def read_frames(reader: asyncio.StreamReader, deliver: Callable[[Envelope], Awaitable[None]]) -> None:
    """Decode frames until the peer closes; `deliver` applies backpressure by awaiting the mailbox."""
    while True:
        try:
            header = await reader.readexactly(_HEADER.size)
            payload = await reader.readexactly(_HEADER.unpack(header)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        await deliver(_decoder.decode(payload))


class Link:
    """The sending end of one connection to another process."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def send(self, env: Envelope) -> None:
        self._writer.write(encode(env))
        await self._writer.drain()

    def send_nowait(self, env: Envelope) -> None:
        self._writer.write(encode(env))

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def tcp_address(addr: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://HOST:PORT` address; None for a Unix socket path."""
    if not addr.startswith("tcp://"):
        return None
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host, int(port)


async def serve(path: Path | str, deliver: Callable[[Envelope], Awaitable[None]]) -> asyncio.AbstractServer:
    """Accept connections on `path` (a Unix socket, or `tcp://HOST:PORT`) and hand every decoded envelope
    to `deliver`."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_frames(reader, deliver)
        except asyncio.CancelledError:
            pass  # the loop is shutting down; this leaf task has nothing to clean up but the socket
        finally:
            writer.close()

    tcp = tcp_address(str(path))
    if tcp is not None:
        return await asyncio.start_server(on_connect, tcp[0], tcp[1], limit=1 << 24, reuse_address=True)
    Path(path).unlink(missing_ok=True)
    return await asyncio.start_unix_server(on_connect, path=str(path), limit=1 << 24)


async def connect(path: Path | str, timeout: float = 60.0) -> Link:
    """Connect to a peer's socket (a Unix path or `tcp://HOST:PORT`), waiting for it to appear (the peer
    may still be starting)."""
    deadline = asyncio.get_running_loop().time() + timeout
    tcp = tcp_address(str(path))
    while True:
        try:
            if tcp is None:
                _, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
            else:
                _, writer = await asyncio.open_connection(tcp[0], tcp[1], limit=1 << 24)
            return Link(writer)
        except (FileNotFoundError, ConnectionRefusedError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)

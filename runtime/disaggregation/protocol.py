"""The transfer protocol between a prefill and a decode engine: msgpack frames, length-prefixed, on the
control connection (always TCP, prefill -> decode's bootstrap port). The KV bytes travel by the backend:
on the same connection (tcp), in a shared-memory segment (shm), through a process-group pair (nccl), or
through the backend's library (nixl, mooncake).

    prefill                                     decode
    Hello(backend, info)            ------>                      (backend sets up the link)
                                    <------    HelloAck(ok, info)
    per chunk of a request (one, or one per prefill chunk; the last is `final`), on one link:
    [stage: e.g. write shm]
    KVHeader(room, start, final, first token, tensors, info) ------>
    [push: bytes / send()]          ------>    [pull: read / recv(), then import into the reserved slots]
                                    <------    KVAck(room, error)
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec
import torch

Struct = msgspec.Struct


class TensorMeta(Struct, frozen=True, array_like=True):
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.torch_dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorMeta:
        return cls(name, str(t.dtype).removeprefix("torch."), list(t.shape))


class Hello(Struct, frozen=True, tag=True, array_like=True):
    backend: str
    info: dict[str, Any] = {}


class HelloAck(Struct, frozen=True, tag=True, array_like=True):
    error: str | None = None
    info: dict[str, Any] = {}


class KVHeader(Struct, frozen=True, tag=True, array_like=True, kw_only=True):
    """One request's KV, or a chunk of it: its tensors (in the order the backend moves them) for the
    positions from `start`; the `final` one also carries the per-request state and the first token.
    Each is acked."""

    room: int
    start: int = 0
    final: bool = True
    token: int = -1
    logprob: float | None = None
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    tensors: list[TensorMeta]
    info: dict[str, Any] = {}  # the backend's (a shared-memory segment's name and offsets, ...)


class KVAck(Struct, frozen=True, tag=True, array_like=True):
    room: int
    error: str | None = None


Frame = Hello | HelloAck | KVHeader | KVAck
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)
_LEN = struct.Struct("!I")


async def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    data = _encoder.encode(frame)
    writer.write(_LEN.pack(len(data)) + data)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return _decoder.decode(await reader.readexactly(n))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)

"""`tcp`: the KV bytes follow the header on the control connection itself (asyncio streams), tensor by
tensor, so one tensor's device-to-host copy overlaps the previous one's send."""

from __future__ import annotations

import asyncio

import torch

from runtime.disaggregation.base import Link, Received, TransferBackend, host_bytes
from runtime.disaggregation.protocol import KVHeader


class TcpBackend(TransferBackend):
    name = "tcp"

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        nxt = asyncio.create_task(asyncio.to_thread(host_bytes, tensors[0])) if tensors else None
        for i in range(len(tensors)):
            data = await nxt
            if i + 1 < len(tensors):
                nxt = asyncio.create_task(asyncio.to_thread(host_bytes, tensors[i + 1]))
            link.writer.write(data)
            await link.writer.drain()

    async def pull(self, link: Link, header: KVHeader) -> Received:
        out = {}
        for meta in header.tensors:
            buf = bytearray(await link.reader.readexactly(meta.nbytes))
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            out[meta.name] = t.view(meta.torch_dtype).reshape(meta.shape)
        return Received(out)

"""`shm`: one host. The sender writes the request's tensors into a fresh POSIX shared-memory segment
(`/dev/shm`) and names it in the header; the receiver maps it and imports straight from it; the sender
unlinks it once the ack came (or the transfer failed), so a segment never outlives its transfer."""

from __future__ import annotations

import asyncio
import mmap
import uuid
from multiprocessing import shared_memory
from typing import Any

import torch

from runtime.disaggregation.base import Link, Received, TransferBackend, host_bytes
from runtime.disaggregation.protocol import KVHeader


def _write(tensors: list[torch.Tensor]) -> tuple[shared_memory.SharedMemory, list[int]]:
    sizes = [t.numel() * t.element_size() for t in tensors]
    # registered with the resource tracker until `unlink`: a segment of a sender that dies is removed
    name = f"conduit-kv-{uuid.uuid4().hex[:16]}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, sum(sizes)))
    offsets, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        shm.buf[at : at + n] = host_bytes(t)
        offsets.append(at)
        at += n
    return shm, offsets


class ShmBackend(TransferBackend):
    name = "shm"

    async def stage(self, link: Link, tensors: list[torch.Tensor]) -> dict[str, Any]:
        shm, offsets = await asyncio.to_thread(_write, tensors)
        link.state["shm"] = shm
        return {"shm": shm.name, "offsets": offsets}

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        return  # the bytes are already in the segment

    def finish(self, link: Link, info: dict[str, Any]) -> None:
        shm = link.state.pop("shm", None)
        if shm is not None:
            shm.close()
            shm.unlink()

    async def pull(self, link: Link, header: KVHeader) -> Received:
        # mapped as a file of /dev/shm, copy-on-write: Python's SharedMemory would register it with the
        # resource tracker, which the sender (its owner) already handles
        with open(f"/dev/shm/{header.info['shm']}", "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        out = {}
        for meta, at in zip(header.tensors, header.info["offsets"], strict=True):
            if meta.nbytes:
                flat = torch.frombuffer(mm, dtype=torch.uint8, count=meta.nbytes, offset=at)
            else:
                flat = torch.empty(0, dtype=torch.uint8)
            out[meta.name] = flat.view(meta.torch_dtype).reshape(meta.shape)

        def close() -> None:
            out.clear()  # the views must go before the mapping can close
            mm.close()

        return Received(out, close)

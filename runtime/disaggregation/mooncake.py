"""`mooncake`: Mooncake's Transfer Engine (RDMA, or its own TCP transport). Needs the
`mooncake-transfer-engine` package (`mooncake.engine.TransferEngine`).

Each side runs one engine (P2P handshake, no metadata server). The sender copies the request's tensors
into one buffer registered with its engine and names its session and address in the header; the
receiver reads it into a buffer registered with its own engine (`transfer_sync_read`), then the
sender unregisters and drops its buffer (after the ack)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from runtime.disaggregation.base import Link, Received, TransferBackend, TransferError
from runtime.disaggregation.protocol import KVHeader


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "--disaggregation-transfer-backend mooncake needs `mooncake-transfer-engine`"
        ) from e
    return TransferEngine


def _flat(tensors: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes back to back in one buffer, and where each starts."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    buf = torch.empty(max(1, sum(sizes)), dtype=torch.uint8, device=device)
    offsets, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        if n:
            buf[at : at + n] = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        offsets.append(at)
        at += n
    return buf, offsets


class MooncakeBackend(TransferBackend):
    name = "mooncake"
    protocol = "tcp"  # "rdma" where the NICs allow it

    def __init__(self, device: torch.device, hostname: str = "127.0.0.1") -> None:
        super().__init__(device)
        self.engine = _engine_class()()
        if self.engine.initialize(hostname, "P2PHANDSHAKE", self.protocol, "") != 0:
            raise RuntimeError("the Mooncake transfer engine failed to initialize")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"

    def _register(self, buf: torch.Tensor) -> None:
        if self.engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
            raise TransferError("Mooncake could not register a transfer buffer")

    async def stage(self, link: Link, tensors: list[torch.Tensor]) -> dict[str, Any]:
        buf, offsets = await asyncio.to_thread(_flat, tensors, self.device)
        self._register(buf)
        link.state["staged"] = buf
        return {"session": self.session, "addr": buf.data_ptr(), "offsets": offsets}

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        return  # the receiver reads

    def finish(self, link: Link, info: dict[str, Any]) -> None:
        buf = link.state.pop("staged", None)
        if buf is not None:
            self.engine.unregister_memory(buf.data_ptr())

    async def pull(self, link: Link, header: KVHeader) -> Received:
        total = sum(m.nbytes for m in header.tensors)
        buf = torch.empty(max(1, total), dtype=torch.uint8, device=self.device)
        self._register(buf)
        try:
            info = header.info
            ret = await asyncio.to_thread(
                self.engine.transfer_sync_read, info["session"], buf.data_ptr(), info["addr"], total
            )
            if ret != 0:
                raise TransferError(f"Mooncake read of transfer {header.room} failed ({ret})")
        finally:
            self.engine.unregister_memory(buf.data_ptr())
        out = {}
        for m, at in zip(header.tensors, info["offsets"], strict=True):
            out[m.name] = buf[at : at + m.nbytes].view(m.torch_dtype).reshape(m.shape)
        return Received(out)

"""`nccl`: torch.distributed point-to-point between the two engines (NCCL on CUDA, gloo on the CPU).

Each link gets its own two-rank process group (rank 0 decode, rank 1 prefill), rendezvous through a
TCPStore the decode side opens for it on a free port (named in HelloAck); the request's tensors then go
as one `send` / `recv` of their bytes on that group, after the header on the control connection. The groups
are built directly (`ProcessGroupGloo` / `ProcessGroupNCCL`), not through `init_process_group`, so
they live beside whatever default group the engine uses for its own ranks."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runtime.disaggregation.base import Link, Received, TransferBackend
from runtime.disaggregation.protocol import KVHeader

_TIMEOUT = timedelta(seconds=60)


class NcclBackend(TransferBackend):
    name = "nccl"

    def _group(self, store: dist.Store, rank: int) -> dist.ProcessGroup:
        if self.device.type == "cuda":
            return dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(store, rank, 2, _TIMEOUT)

    async def accept(self, link: Link, info: dict[str, Any]) -> dict[str, Any]:
        host = link.writer.get_extra_info("sockname")[0]
        store = dist.TCPStore(host, 0, 2, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)
        link.state["store"] = store
        # the group forms once the peer joins too, after it read the store's port: do not wait here
        link.state["group"] = asyncio.get_running_loop().run_in_executor(None, self._group, store, 0)
        return {"host": host, "port": store.port}

    async def connected(self, link: Link, info: dict[str, Any]) -> None:
        store = dist.TCPStore(info["host"], info["port"], 2, is_master=False, timeout=_TIMEOUT)
        link.state["store"] = store
        link.state["group"] = await asyncio.to_thread(self._group, store, 1)

    async def _pg(self, link: Link) -> dist.ProcessGroup:
        pg = link.state["group"]
        if isinstance(pg, asyncio.Future):
            pg = link.state["group"] = await pg
        return pg

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        """All tensors in one message: a point-to-point send costs per message, far more over gloo."""
        pg = await self._pg(link)

        def send() -> None:
            flat = [t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device) for t in tensors]
            pg.send([torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)], 0, 0).wait()

        await asyncio.to_thread(send)

    async def pull(self, link: Link, header: KVHeader) -> Received:
        pg = await self._pg(link)
        buf = torch.empty(sum(m.nbytes for m in header.tensors), dtype=torch.uint8, device=self.device)
        await asyncio.to_thread(lambda: pg.recv([buf], 1, 0).wait())
        out, at = {}, 0
        for m in header.tensors:
            out[m.name] = buf[at : at + m.nbytes].view(m.torch_dtype).reshape(m.shape)
            at += m.nbytes
        return Received(out)

    def close(self, link: Link) -> None:
        link.state.clear()  # drops the group and the store
        link.close()

"""`nccl`: torch.distributed point-to-point between the two engines (NCCL on CUDA, gloo on the CPU).

Each link gets its own two-rank process group (rank 0 decode, rank 1 prefill), rendezvous through a
TCPStore the decode side opens for it on a free port (named in HelloAck); the tensors then go by
`send` / `recv` on that group, one per tensor, after the header on the control connection. The groups
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

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().to(self.device)

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        pg = await self._pg(link)

        def send() -> None:
            for t in tensors:
                pg.send([self._on_device(t)], 0, 0).wait()

        await asyncio.to_thread(send)

    async def pull(self, link: Link, header: KVHeader) -> Received:
        pg = await self._pg(link)
        out = {m.name: torch.empty(m.shape, dtype=m.torch_dtype, device=self.device) for m in header.tensors}

        def recv() -> None:
            for m in header.tensors:
                pg.recv([out[m.name]], 1, 0).wait()

        await asyncio.to_thread(recv)
        return Received(out)

    def close(self, link: Link) -> None:
        link.state.clear()  # drops the group and the store
        link.close()

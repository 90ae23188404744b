"""`nixl`: NVIDIA's NIXL (UCX and other transports; GPU memory directly where the transport allows).
Needs the `nixl` package.

One-sided reads: the sender registers the request's tensors with its agent and sends their serialized
descriptors in the header; the receiver, which added the sender's agent (its metadata came in Hello),
registers fresh tensors of the same shapes and READs into them, polling the transfer state until DONE;
then the sender deregisters its tensors (after the ack)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import torch

from runtime.disaggregation.base import Link, Received, TransferBackend, TransferError
from runtime.disaggregation.protocol import KVHeader


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise RuntimeError("--disaggregation-transfer-backend nixl needs the `nixl` package") from e
    return nixl_agent, nixl_agent_config


class NixlBackend(TransferBackend):
    name = "nixl"
    poll_s = 0.0005

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        nixl_agent, nixl_agent_config = _nixl_api()
        self.agent = nixl_agent(f"conduit-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))

    async def connect(self, link: Link) -> dict[str, Any]:
        return {"metadata": self.agent.get_agent_metadata()}

    async def accept(self, link: Link, info: dict[str, Any]) -> dict[str, Any]:
        link.state["peer"] = self.agent.add_remote_agent(info["metadata"])
        return {}

    async def stage(self, link: Link, tensors: list[torch.Tensor]) -> dict[str, Any]:
        staged = [t.contiguous() for t in tensors]
        link.state["staged"] = (staged, self.agent.register_memory(staged))
        descs = self.agent.get_xfer_descs(staged)
        return {"descs": self.agent.get_serialized_descs(descs)}

    async def push(self, link: Link, tensors: list[torch.Tensor]) -> None:
        return  # the receiver reads

    def finish(self, link: Link, info: dict[str, Any]) -> None:
        staged = link.state.pop("staged", None)
        if staged is not None:
            self.agent.deregister_memory(staged[1])

    async def pull(self, link: Link, header: KVHeader) -> Received:
        out = [torch.empty(m.shape, dtype=m.torch_dtype, device=self.device) for m in header.tensors]
        reg = self.agent.register_memory(out)
        try:
            local = self.agent.get_xfer_descs(out)
            remote = self.agent.deserialize_descs(header.info["descs"])
            handle = self.agent.initialize_xfer(
                "READ", local, remote, link.state["peer"], str(header.room).encode()
            )
            try:
                state = self.agent.transfer(handle)
                while state != "DONE":
                    if state == "ERR":
                        raise TransferError(f"NIXL read of transfer {header.room} failed")
                    await asyncio.sleep(self.poll_s)
                    state = self.agent.check_xfer_state(handle)
            finally:
                self.agent.release_xfer_handle(handle)
        finally:
            self.agent.deregister_memory(reg)
        return Received({m.name: t for m, t in zip(header.tensors, out, strict=True)})

    def close(self, link: Link) -> None:
        peer = link.state.pop("peer", None)
        if peer is not None:
            self.agent.remove_remote_agent(peer)
        link.close()

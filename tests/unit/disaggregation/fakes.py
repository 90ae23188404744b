"""Stand-ins for the `nixl` and `mooncake` libraries with the API the adapters call, moving bytes for
real between buffers of this process (so an adapter that registers, describes or reads the wrong thing
fails its round trip)."""

from __future__ import annotations

import ctypes
import itertools
import json
import sys
import types

import torch


class FakeNixl:
    def __init__(self) -> None:
        self.agents: dict[str, FakeNixlAgent] = {}
        self.reads = 0

    def registered(self) -> int:
        return sum(len(a.regions) for a in self.agents.values())


class FakeNixlAgent:
    world: FakeNixl

    def __init__(self, name: str, config) -> None:  # noqa: ANN001
        assert config.backends == ["UCX"]
        self.name = name
        self.regions: dict[int, torch.Tensor] = {}  # data_ptr -> registered tensor
        self.remotes: set[str] = set()
        self.handles = itertools.count(1)
        self.pending: dict[int, tuple] = {}
        self.world.agents[name] = self

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        self.remotes.add(metadata.decode())
        return metadata.decode()

    def remove_remote_agent(self, name: str) -> None:
        self.remotes.discard(name)

    def register_memory(self, tensors: list[torch.Tensor]) -> list[int]:
        for t in tensors:
            self.regions[t.data_ptr()] = t
        return [t.data_ptr() for t in tensors]

    def deregister_memory(self, reg: list[int]) -> None:
        for ptr in reg:
            del self.regions[ptr]

    def get_xfer_descs(self, tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]

    def get_serialized_descs(self, descs: list[tuple[int, int]]) -> bytes:
        return json.dumps(descs).encode()

    def deserialize_descs(self, data: bytes) -> list[tuple[int, int]]:
        return [tuple(d) for d in json.loads(data)]

    def initialize_xfer(self, op: str, local, remote, peer: str, notif: bytes) -> int:  # noqa: ANN001
        assert op == "READ" and peer in self.remotes, (op, peer)
        owner = self.world.agents[peer]
        for (lp, ln), (rp, rn) in zip(local, remote, strict=True):
            assert ln == rn and lp in self.regions and rp in owner.regions, "unregistered memory"
        h = next(self.handles)
        self.pending[h] = (local, remote)
        return h

    def transfer(self, handle: int) -> str:
        local, remote = self.pending[handle]
        for (lp, n), (rp, _) in zip(local, remote, strict=True):
            ctypes.memmove(lp, rp, n)
        self.world.reads += 1
        return "PROC"  # done on the next poll

    def check_xfer_state(self, handle: int) -> str:
        return "DONE"

    def release_xfer_handle(self, handle: int) -> None:
        del self.pending[handle]


def install_fake_nixl(monkeypatch) -> FakeNixl:  # noqa: ANN001
    world = FakeNixl()
    agent = type("nixl_agent", (FakeNixlAgent,), {"world": world})
    api = types.ModuleType("nixl._api")
    api.nixl_agent = agent
    api.nixl_agent_config = lambda backends: types.SimpleNamespace(backends=backends)
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    return world


class FakeMooncake:
    def __init__(self) -> None:
        self.engines: dict[str, FakeTransferEngine] = {}
        self.ports = itertools.count(17000)
        self.reads = 0

    def registered(self) -> int:
        return sum(len(e.regions) for e in self.engines.values())


class FakeTransferEngine:
    world: FakeMooncake

    def __init__(self) -> None:
        self.regions: dict[int, int] = {}  # ptr -> length
        self.port = 0

    def initialize(self, hostname: str, metadata_server: str, protocol: str, device: str) -> int:
        assert metadata_server == "P2PHANDSHAKE"
        self.port = next(self.world.ports)
        self.world.engines[f"{hostname}:{self.port}"] = self
        return 0

    def get_rpc_port(self) -> int:
        return self.port

    def register_memory(self, ptr: int, length: int) -> int:
        self.regions[ptr] = length
        return 0

    def unregister_memory(self, ptr: int) -> int:
        del self.regions[ptr]
        return 0

    def transfer_sync_read(self, session: str, buffer: int, peer_address: int, length: int) -> int:
        peer = self.world.engines[session]
        if buffer not in self.regions or peer.regions.get(peer_address, -1) < length:
            return -1  # unregistered memory
        ctypes.memmove(buffer, peer_address, length)
        self.world.reads += 1
        return 0


def install_fake_mooncake(monkeypatch) -> FakeMooncake:  # noqa: ANN001
    world = FakeMooncake()
    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = type("TransferEngine", (FakeTransferEngine,), {"world": world})
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    return world

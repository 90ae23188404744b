"""Every KV transfer backend moves a request's tensors (several dtypes, an empty one, V4-like int state)
from a KVSender to a KVReceiver exactly, over links that are reused; refusals, a dead peer and a peer
that never answers end in TransferError, not a hang. nixl and mooncake run against stand-in modules
with their libraries' API (tests/unit/disaggregation/fakes.py) that move the bytes for real in this
process."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loadgen.launch import free_port
from runtime.disaggregation.base import FirstToken, KVReceiver, KVSender, TransferError, make_backend
from tests.unit.disaggregation.fakes import install_fake_mooncake, install_fake_nixl

BACKENDS = ["tcp", "shm", "nccl", "nixl", "mooncake"]


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    fake = None
    if name == "nixl":
        fake = install_fake_nixl(monkeypatch)
    elif name == "mooncake":
        fake = install_fake_mooncake(monkeypatch)
    return name, fake


def request_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "slot.k.0": torch.randn(37, 2, 8, generator=g).to(torch.bfloat16),
        "slot.v.0": torch.randn(37, 2, 8, generator=g),
        "slot.entries.1": torch.randn(0, 16, generator=g),  # no closed compression window yet
        "row.start": torch.tensor([5], dtype=torch.int64),
        "row.ring.0": torch.randn(8, 4, generator=g).to(torch.float16),
    }


async def _round_trip(name: str, transfers: int) -> tuple[list, KVSender]:
    got = []

    async def on_kv(header, received):
        got.append(
            (header.room, header.token, header.logprob, {k: v.clone() for k, v in received.tensors.items()})
        )
        return None

    port = free_port()
    receiver = KVReceiver(make_backend(name), on_kv)
    await receiver.start("127.0.0.1", port)
    sender = KVSender(make_backend(name), timeout=30)
    try:
        for i in range(transfers):
            await sender.send(
                f"127.0.0.1:{port}", 100 + i, request_kv(i), FirstToken(7 + i, -0.5, [7], [-0.5])
            )
    finally:
        sender.close()
        await receiver.stop()
    return got, sender


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_a_request_kv_arrives_exactly_and_links_are_reused(backend):
    name, fake = backend
    got, sender = asyncio.run(_round_trip(name, 3))
    assert [(room, token, lp) for room, token, lp, _ in got] == [
        (100, 7, -0.5),
        (101, 8, -0.5),
        (102, 9, -0.5),
    ]
    for i, (_, _, _, tensors) in enumerate(got):
        want = request_kv(i)
        assert tensors.keys() == want.keys()
        for k, v in want.items():
            assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v), k
    if fake is not None:  # every buffer the adapter registered was given back
        assert fake.registered() == 0
        assert fake.reads == 3


def test_a_refused_transfer_raises_and_the_link_is_not_kept():
    async def go():
        async def refuse(header, received):
            return "no request waits for it"

        port = free_port()
        receiver = KVReceiver(make_backend("tcp"), refuse)
        await receiver.start("127.0.0.1", port)
        sender = KVSender(make_backend("tcp"), timeout=10)
        try:
            with pytest.raises(TransferError, match="no request waits for it"):
                await sender.send(f"127.0.0.1:{port}", 1, request_kv(0), FirstToken(1))
        finally:
            sender.close()
            await receiver.stop()

    asyncio.run(go())


def test_a_dead_or_silent_decode_side_fails_the_transfer_in_time():
    async def go():
        sender = KVSender(make_backend("tcp"), timeout=1.0)
        with pytest.raises(TransferError, match="failed"):  # nobody listens
            await sender.send(f"127.0.0.1:{free_port()}", 1, request_kv(0), FirstToken(1))

        async def silent(reader, writer):  # accepts, never answers
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TransferError, match="timed out"):
            await sender.send(f"127.0.0.1:{port}", 1, request_kv(0), FirstToken(1))
        assert asyncio.get_running_loop().time() - t0 < 5
        server.close()

    asyncio.run(go())


def test_a_backend_the_decode_side_does_not_use_is_refused():
    async def go():
        async def on_kv(header, received):
            return None

        port = free_port()
        receiver = KVReceiver(make_backend("shm"), on_kv)
        await receiver.start("127.0.0.1", port)
        sender = KVSender(make_backend("tcp"), timeout=10)
        try:
            with pytest.raises(TransferError, match="uses shm, not tcp"):
                await sender.send(f"127.0.0.1:{port}", 1, request_kv(0), FirstToken(1))
        finally:
            await receiver.stop()

    asyncio.run(go())


def test_unknown_backends_and_missing_libraries_are_clear_errors():
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        make_backend("carrier-pigeon")
    for name, package in (("nixl", "nixl"), ("mooncake", "mooncake")):
        try:
            __import__(package)
        except ImportError:
            with pytest.raises(RuntimeError, match="needs"):
                make_backend(name)

"""Every placement returns the rows the device placement (the whole table) returns: `host` through
EngramShardActor processes over the mailbox transport and read in place from the shared-memory table
the shards fill (mapped; on the CPU without the CUDA registration), `split` over a 2-process gloo group.
A host shard that is killed fails the lookups that need it (mapped: every step) with StepFailed, is
restarted, and serves again."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loadgen.launch import free_port
from runtime.engram.config import EngramConfig
from runtime.engram.hashing import NgramHasher
from runtime.engram.host import HostPlacement
from runtime.engram.placement import DevicePlacement, SplitPlacement
from runtime.errors import StepFailed

CFG = EngramConfig(layer_ids=(1, 4), n_embed_per_ngram=32, n_head_per_ngram=4, engram_vocab_size=(1009, 2003))
LOOKUP = np.arange(500) % 433


def _addresses(hasher: NgramHasher, seed: int, n: int = 37) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 500, size=n)
    return hasher.addresses(ids, 0, n)


@pytest.fixture(scope="module")
def hasher():
    return NgramHasher(CFG, LOOKUP)


@pytest.fixture(scope="module")
def device(hasher):
    return DevicePlacement(CFG, hasher, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def host(hasher):
    p = HostPlacement(CFG, hasher, torch.device("cpu"), torch.float32, shards=3, mapped=True)
    yield p
    p.close()


def test_host_shards_return_the_device_rows(hasher, device, host):
    for seed in range(3):
        addr = _addresses(hasher, seed)
        want = device.fetch(addr)()
        torch.testing.assert_close(host.fetch(addr)(), want, rtol=0, atol=0)
        torch.testing.assert_close(host.device_table[torch.from_numpy(addr)], want, rtol=0, atol=0)


def test_killed_host_shard_fails_lookups_then_restarts(hasher, device, host):
    addr = _addresses(hasher, 7)
    pid = host.pids[1]
    ready_before = host.restarts
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(StepFailed, match="Engram shard 1 .* crashed"):
        for _ in range(1000):  # until the death is noticed: every lookup from then on fails
            host.fetch(addr)()
    if host.down:  # mapped reads fail too until the shard is back
        with pytest.raises(StepFailed, match="Engram shard 1 .* crashed"):
            host.check()
    assert host.wait_all_up(60)
    host.check()  # the restarted shard announced itself (NodeReady)
    assert host.restarts == ready_before + 1 and host.pids[1] != pid
    want = device.fetch(addr)()
    torch.testing.assert_close(host.fetch(addr)(), want, rtol=0, atol=0)
    torch.testing.assert_close(host.device_table[torch.from_numpy(addr)], want, rtol=0, atol=0)


def _split_rank(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        hasher = NgramHasher(CFG, LOOKUP)
        split = SplitPlacement(CFG, hasher, torch.device("cpu"), torch.float32)
        out[rank] = [split.fetch(_addresses(hasher, seed))().clone() for seed in range(3)]
        out[f"range{rank}"] = (split.lo, split.hi)
    finally:
        dist.destroy_process_group()


def test_split_over_gloo_returns_the_device_rows(hasher, device):
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_split_rank, args=(port, out), nprocs=2, join=True)
        out = dict(out)
    assert out["range0"][1] == out["range1"][0]  # each rank holds its own range
    for rank in (0, 1):
        for seed in range(3):
            want = device.fetch(_addresses(hasher, seed))()
            torch.testing.assert_close(out[rank][seed], want, rtol=0, atol=0)

"""EngramShardActor: one process owning a row range [lo, hi) of the Engram tables in host memory and
answering batched lookups (`EngramLookup`) from a worker's Engram client over the mailbox transport.

Its rows live in the table's shared-memory file (the client creates it; each shard fills its range),
so a worker on CUDA reads them in place (the mapped `host` placement). Mailbox lookups: addresses and
rows travel through shared memory the client names in each lookup: the shard reads the addresses there
and writes the rows it owns into the output region in place, then answers with a small
`EngramLookupDone`. Started by the client's actor system (`runtime/engram/host.py`) as
`python -m runtime.actors.engram_shard` with `EngramShardArgs` on stdin; a shard that dies is restarted
by that system and regenerates (or reloads) its rows."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import sys
import traceback
from pathlib import Path

import msgspec
import structlog
import torch

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.actors.system import ActorSystem
from runtime.engram.config import EngramConfig
from runtime.engram.tables import load_rows
from runtime.mailbox.messages import EngramLookup, EngramLookupDone, Message, NodeFailed, NodeReady

log = structlog.get_logger(__name__)


def shard_address(i: int) -> str:
    return f"engram/shard/{i}"


def shard_node(client_node: str, i: int) -> str:
    return f"{client_node}-shard{i}"


class EngramShardArgs(msgspec.Struct, frozen=True):
    shard: int
    lo: int
    hi: int
    engram: dict  # EngramConfig's fields
    layer_rows: dict[int, tuple[int, int]]
    dtype: str
    table: str  # the table's shared-memory file (this shard fills rows lo..hi of it)
    client_node: str
    placement: dict[str, str]
    sock_dir: str
    threads: int = 1  # torch threads of the gather


def map_segment(path: str, size: int = 0) -> mmap.mmap:
    """A shared-memory file mapped read-write (created with `size` bytes when size > 0; the client
    creates and removes them, a shard only maps them)."""
    flags = os.O_RDWR | (os.O_CREAT if size else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size or os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _segment(path: str, cache: dict[str, mmap.mmap]) -> mmap.mmap:
    seg = cache.get(path)
    if seg is None:
        for old in cache.values():
            old.close()
        cache.clear()
        seg = cache[path] = map_segment(path)
    return seg


class EngramShardActor(Actor):
    def __init__(self, args: EngramShardArgs) -> None:
        super().__init__(shard_address(args.shard))
        self.args = args
        self.rows: torch.Tensor | None = None
        self._segments: dict[str, mmap.mmap] = {}

    async def on_start(self) -> None:
        a = self.args
        cfg = EngramConfig(**{**a.engram, "layer_ids": tuple(a.engram["layer_ids"]),
                              "engram_vocab_size": tuple(a.engram["engram_vocab_size"])})  # fmt: skip
        dtype = getattr(torch, a.dtype)
        dim = cfg.head_dim
        table = map_segment(a.table)
        self.rows = torch.frombuffer(
            table, dtype=dtype, count=(a.hi - a.lo) * dim, offset=a.lo * dim * dtype.itemsize
        ).view(-1, dim)
        # a restarted shard rewrites the same bytes: a worker reading them meanwhile sees no change
        self.rows.copy_(await asyncio.to_thread(load_rows, cfg, a.layer_rows, a.lo, a.hi, dtype))
        log.info("engram_shard_ready", shard=a.shard, rows=f"{a.lo}..{a.hi}", pid=os.getpid())

    async def handle(self, msg: Message) -> None:
        if not isinstance(msg, EngramLookup):
            return
        owned = self.lookup(msg)
        await self.send(msg.reply_to, EngramLookupDone(msg.id, self.args.shard, owned))

    def lookup(self, msg: EngramLookup) -> int:
        rows, lo, hi = self.rows, self.args.lo, self.args.hi
        seg = _segment(msg.segment, self._segments)
        count = msg.n * msg.columns
        addr = torch.frombuffer(seg, dtype=torch.int64, count=count)
        out = torch.frombuffer(seg, dtype=rows.dtype, count=count * rows.shape[1], offset=count * 8)
        mine = ((addr >= lo) & (addr < hi)).nonzero().squeeze(1)
        out.view(count, rows.shape[1])[mine] = rows[addr[mine] - lo]
        return int(mine.numel())


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client's process stops us (Shutdown, SIGTERM)
    from runtime.logging import setup_logging

    setup_logging()
    asyncio.run(_serve(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngramShardArgs)))


async def _serve(a: EngramShardArgs) -> None:
    torch.set_num_threads(a.threads)
    node = shard_node(a.client_node, a.shard)
    system = ActorSystem(node, a.placement, Path(a.sock_dir))
    await system.listen()
    try:
        await system.spawn(EngramShardActor(a))
    except Exception as exc:
        log.error("engram_shard_start_failed", shard=a.shard, error=str(exc), trace=traceback.format_exc())
        await system.send_to_node(
            a.client_node, addresses.SYSTEM, NodeFailed(node, f"{type(exc).__name__}: {exc}")
        )
        await asyncio.sleep(0.2)
        return
    await system.send_to_node(a.client_node, addresses.SYSTEM, NodeReady(node, {"pid": str(os.getpid())}))
    parent = os.getppid()
    while not system.shutdown_requested.is_set():
        try:
            await asyncio.wait_for(system.shutdown_requested.wait(), 1.0)
        except TimeoutError:
            if os.getppid() != parent:  # orphaned: the worker died without telling us
                break
    await system.stop()


if __name__ == "__main__":
    main()

"""The `host` placement: Engram rows in host memory, in one shared-memory table file whose row ranges
EngramShardActor processes (runtime/actors/engram_shard.py) fill and serve; this worker's client starts
and supervises them.

Mapped (the default on CUDA): the worker maps the table and registers it with CUDA as pinned mapped
memory (`cudaHostRegister`; under unified addressing the host pointer is valid in kernels), seen by
torch as a CUDA tensor aliasing host memory (`device_table`). A step gathers its rows from it with one
index on the device, over PCIe, with no process hop and no host sync, inside the decode CUDA graphs.

Mailbox (the CPU worker, and the semantics oracle): the client is a small actor system of its own (node
`engram-client-<pid>`, on a thread with its own event loop, beside the worker's): a lookup writes the
step's addresses into a shared-memory segment, sends every shard an `EngramLookup` over the mailbox
transport, and each shard writes the rows it owns into the segment's output region in place; the rows
are ready when every shard answered `EngramLookupDone`. On the CPU the model reads them there without a
copy (two segments alternate, so a step's rows stay valid while the next lookup fills the other); on
CUDA they are copied to the device.

A shard that dies fails the lookups waiting on it, and every lookup (mapped: every step) until it is
back, with `StepFailed` (the scheduler fails that step's requests with a 503 and keeps serving); the
actor system restarts the process, which rewrites its rows (the same bytes) in the table file."""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import itertools
import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path

import msgspec
import numpy as np
import structlog
import torch

from runtime.actors.base import Actor
from runtime.actors.engram_shard import EngramShardArgs, map_segment, shard_address, shard_node
from runtime.actors.system import ActorSystem
from runtime.engram.config import EngramConfig
from runtime.engram.hashing import NgramHasher
from runtime.engram.placement import EngramPlacement
from runtime.engram.tables import shard_ranges
from runtime.errors import StepFailed
from runtime.mailbox.messages import EngramLookup, EngramLookupDone, Message, NodeFailed, NodeReady

log = structlog.get_logger(__name__)

CLIENT = "engram/client"
START_TIMEOUT_S = 600.0
LOOKUP_TIMEOUT_S = 120.0
MAX_RESTARTS = 5


class _Client(Actor):
    """Receives the shards' answers for the placement (on the client's event loop)."""

    def __init__(self, placement: HostPlacement) -> None:
        super().__init__(CLIENT)
        self.placement = placement

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, EngramLookupDone):
            self.placement._done(msg)


class _Segment:
    def __init__(self, path: Path, size: int, pin: bool) -> None:
        self.path, self.size = path, size
        self.buf = map_segment(str(path), size)
        self.pinned = pin and _pin(self.buf, size)


def _room(directory: Path, nbytes: int) -> bool:
    """Whether a file system (a small /dev/shm in containers) has room for `nbytes` and some to spare."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize >= nbytes + (256 << 20)


def _table_file(directory: Path, node: str, nbytes: int) -> Path:
    """The table's shared-memory file, sized and empty (the shards fill their row ranges)."""
    path = directory / f"{node}-table"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def _pin(buf: mmap.mmap, size: int) -> bool:
    """Page-lock the mapping for the GPU (cudaHostRegister), so rows go to the device by DMA without a
    staging copy; False (pageable copies) when CUDA refuses."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        log.warning("engram_segment_not_pinned", error=int(err), bytes=size)
        return False
    return True


class _HostArray:
    """Registered host memory as a CUDA array for `torch.as_tensor` (as int16 / int32: the interface
    has no bfloat16; the tensor is viewed as the table's dtype)."""

    def __init__(self, ptr: int, rows: int, dim: int, itemsize: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (rows, dim), "typestr": f"<i{itemsize}", "data": (ptr, False), "version": 3,
            "strides": None,
        }  # fmt: skip


class HostPlacement(EngramPlacement):
    name = "host"

    def __init__(
        self,
        cfg: EngramConfig,
        hasher: NgramHasher,
        device: torch.device,
        dtype: torch.dtype,
        shards: int = 2,
        mapped: bool | None = None,
    ) -> None:
        """`mapped`: the step's device reads rows from the table in place (None: on CUDA)."""
        super().__init__(cfg, hasher, device, dtype)
        self.ranges = shard_ranges(hasher.total_rows, shards)
        self.node = f"engram-client-{os.getpid()}-{id(self):x}"
        self.dir = Path(tempfile.mkdtemp(prefix="conduit-engram-"))
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.dir
        self._seg_prefix = shm / f"{self.node}-seg"
        nbytes = hasher.total_rows * cfg.head_dim * dtype.itemsize
        self.table_path = _table_file(shm if _room(shm, nbytes) else self.dir, self.node, nbytes)
        self.mapped = device.type == "cuda" if mapped is None else mapped
        self._table: torch.Tensor | None = None
        self._host_table: torch.Tensor | None = None  # the mapping (the CUDA tensor aliases it)
        self._registered: int | None = None  # the table's host pointer, while registered with CUDA
        self._segments: list[_Segment | None] = [None, None]
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._up = threading.Condition(self._lock)  # notified when a shard is ready again
        self._pending: dict[int, tuple[Future, set[int]]] = {}
        self.down: dict[int, str] = {}  # shard -> why, until it is ready again
        self.pids: dict[int, int] = {}
        self.restarts = 0
        placement = {CLIENT: self.node} | {shard_address(i): shard_node(self.node, i) for i in range(shards)}
        self.system = ActorSystem(self.node, placement, self.dir)
        atexit.register(self.close)  # shard processes and shared-memory files go with this process
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engram-client", daemon=True)
        self._thread.start()
        try:
            self._call(self._start(placement), START_TIMEOUT_S)
            if self.mapped:
                self._table = self._map_table(nbytes)
        except BaseException:
            self.close()
            raise

    @property
    def device_table(self) -> torch.Tensor | None:
        return self._table

    def check(self) -> None:
        with self._lock:
            if self.down:
                raise StepFailed(next(iter(self.down.values())))

    def _map_table(self, nbytes: int) -> torch.Tensor | None:
        """The filled table as a tensor on the worker's device aliasing the shared memory (None, and
        mailbox lookups, when CUDA cannot register it)."""
        buf = map_segment(str(self.table_path))
        table = self._host_table = torch.frombuffer(buf, dtype=self.dtype).view(-1, self.cfg.head_dim)
        if self.device.type != "cuda":
            return table
        ptr = table.data_ptr()
        # portable (every device) | mapped (device-visible); kept until close
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1 | 2))
        if err != 0:
            log.warning("engram_table_not_mapped", error=err, bytes=nbytes, fallback="mailbox lookups")
            self.mapped = False
            return None
        self._registered = ptr
        arr = _HostArray(ptr, table.shape[0], table.shape[1], self.dtype.itemsize)
        try:
            return torch.as_tensor(arr, device=self.device).view(self.dtype)
        except (RuntimeError, TypeError) as exc:
            log.warning("engram_table_not_mapped", error=str(exc), fallback="mailbox lookups")
            self.mapped = False
            return None

    def _call(self, coro, timeout: float):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, placement: dict[str, str]) -> None:
        system = self.system
        await system.listen()
        await system.spawn(_Client(self))
        system.on_node_failed.append(self._on_failed)
        system.on_node_ready.append(self._on_ready)
        engram = asdict(self.cfg)
        dtype = str(self.dtype).removeprefix("torch.")
        threads = max(1, (os.cpu_count() or 1) // len(self.ranges))  # the shards share the host's cores
        for i, (lo, hi) in enumerate(self.ranges):
            args = EngramShardArgs(
                shard=i, lo=lo, hi=hi, engram=engram, layer_rows=self.hasher.layer_ranges, dtype=dtype,
                table=str(self.table_path), client_node=self.node, placement=placement, sock_dir=str(self.dir),
                threads=threads,
            )  # fmt: skip
            payload = msgspec.msgpack.encode(args)
            await system.start_child(
                shard_node(self.node, i), "runtime.actors.engram_shard", payload, MAX_RESTARTS
            )
        for i in range(len(self.ranges)):
            await system.wait_ready(shard_node(self.node, i), START_TIMEOUT_S)
        log.info("engram_shards_ready", shards=len(self.ranges), rows=self.hasher.total_rows, pids=self.pids)

    # ------------------------------------------------------------------ supervision (client loop)

    def _shard_of(self, node: str) -> int | None:
        prefix = f"{self.node}-shard"
        return int(node[len(prefix) :]) if node.startswith(prefix) else None

    def _on_ready(self, msg: NodeReady) -> None:
        i = self._shard_of(msg.node)
        if i is None:
            return
        with self._lock:
            if i in self.down:
                self.restarts += 1
                log.info("engram_shard_restarted", shard=i, pid=msg.info.get("pid"))
            self.down.pop(i, None)
            self.pids[i] = int(msg.info.get("pid", 0))
            self._up.notify_all()

    def wait_all_up(self, timeout: float) -> bool:
        """Wait until no shard is down (restarted ones ready again); False at the timeout."""
        with self._up:
            return self._up.wait_for(lambda: not self.down, timeout)

    def _on_failed(self, msg: NodeFailed) -> None:
        i = self._shard_of(msg.node)
        if i is None:
            return
        lo, hi = self.ranges[i]
        why = f"Engram shard {i} (rows {lo}..{hi}) crashed ({msg.error}); it is being restarted"
        log.error("engram_shard_failed", shard=i, error=msg.error)
        with self._lock:
            self.down[i] = why
            failed = [fut for fut, waiting in self._pending.values() if i in waiting]
        for fut in failed:
            if not fut.done():
                fut.set_exception(StepFailed(why))

    def _done(self, msg: EngramLookupDone) -> None:
        with self._lock:
            entry = self._pending.get(msg.id)
            if entry is None:
                return
            fut, waiting = entry
            waiting.discard(msg.shard)
            if waiting:
                return
            del self._pending[msg.id]
        if not fut.done():
            fut.set_result(None)

    # ------------------------------------------------------------------ lookups (lookup thread)

    def _segment(self, k: int, size: int) -> _Segment:
        seg = self._segments[k]
        if seg is None or seg.size < size:
            if seg is not None:  # the old mapping goes with the last step's rows that view it
                seg.path.unlink(missing_ok=True)
            size = max(size, 1 << 20)
            path = Path(f"{self._seg_prefix}{k}-{size}")
            seg = self._segments[k] = _Segment(path, size, pin=self.device.type == "cuda")
        return seg

    def fetch(self, addresses: np.ndarray) -> Callable[[], torch.Tensor]:
        n, cols = addresses.shape
        dim, count = self.cfg.head_dim, addresses.size
        lookup_id = next(self._ids)
        seg = self._segment(lookup_id % 2, count * 8 + count * dim * self.dtype.itemsize)
        torch.frombuffer(seg.buf, dtype=torch.int64, count=count).copy_(
            torch.from_numpy(addresses.reshape(-1))
        )
        out = torch.frombuffer(seg.buf, dtype=self.dtype, count=count * dim, offset=count * 8).view(
            n, cols, dim
        )
        fut: Future = Future()
        with self._lock:
            if self.down:
                fut.set_exception(StepFailed(next(iter(self.down.values()))))
            else:
                self._pending[lookup_id] = (fut, set(range(len(self.ranges))))
        if not fut.done():
            msg = EngramLookup(lookup_id, n, cols, str(seg.path), CLIENT)
            self.loop.call_soon_threadsafe(self._send_all, msg)

        def wait() -> torch.Tensor:
            try:
                fut.result(LOOKUP_TIMEOUT_S)
            finally:
                with self._lock:
                    self._pending.pop(lookup_id, None)
            if self.device.type == "cpu":
                return out
            # pinned: an asynchronous copy (the segment is next written two lookups later, after this
            # step's forward was enqueued behind the copy)
            return out.to(self.device, non_blocking=seg.pinned)

        return wait

    def _send_all(self, msg: EngramLookup) -> None:
        for i in range(len(self.ranges)):
            self.loop.create_task(self.system.send(shard_address(i), msg))

    def close(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self.loop.is_running():
            try:
                self._call(self.system.stop(), 30)
            except Exception as exc:  # noqa: BLE001 (closing: report, keep releasing)
                log.warning("engram_client_stop_failed", error=str(exc))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        for seg in self._segments:
            if seg is not None:
                seg.path.unlink(missing_ok=True)
        self.table_path.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)

"""The worker's half of Engram: the placement that holds the tables, and each step's lookup.

On the device (placements with a `device_table`: `device`, mapped `host`): the step hashes its tokens
on the device (`device_hash.py`) and gathers their rows from the table with one index, all on the
step's stream with no host sync, so decode steps run as CUDA graphs (`graph_rows`); the scheduler
sends no addresses (`wants_addresses`). Otherwise:

`start(plan)` reads the step's addresses from the plan (computed by the scheduler, `addresses.py`) and
starts the fetch at once on the lookup thread (prefetch). The fetch runs while the host builds the batch
and the device runs the layers below the first Engram layer, and that layer waits for the rows
(`EngramRows.rows`). A decode row's address arrives as a partial hash. The lookup thread completes it
with the token the previous step sampled (`sampled`), waiting for that token's copy to the host. With
prefetch off, the fetch runs only when the first Engram layer asks for it."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.engram.config import EngramConfig, EngramOptions
from runtime.engram.device_hash import DeviceHasher
from runtime.engram.hashing import NgramHasher
from runtime.engram.host import HostPlacement
from runtime.engram.placement import DevicePlacement, EngramPlacement, EngramRows, SplitPlacement
from runtime.errors import StepFailed
from runtime.gpu.distributed import own_group
from runtime.mailbox.messages import EngramCounters

if TYPE_CHECKING:
    from pathlib import Path

    from runtime.config import RunnerConfig
    from runtime.gpu.forward_batch import ForwardBatch
    from runtime.mailbox.messages import StepPlan


def wide_rows(table: torch.Tensor) -> torch.Tensor:
    """The table [rows, dim] seen as rows of the widest words (16, 8 or 4 bytes) its row size allows: a
    gather moves one word per thread, and over PCIe (a mapped host table) each read is a transaction,
    so 16-byte words read a bf16 row in an eighth of the transactions of 2-byte elements."""
    row_bytes = table.shape[1] * table.element_size()
    for word in (torch.complex128, torch.int64, torch.int32):
        if row_bytes % word.itemsize == 0:
            return table.view(word)
    return table


PLACEMENTS: dict[str, type[EngramPlacement]] = {
    "device": DevicePlacement,
    "host": HostPlacement,
    "split": SplitPlacement,
}


def make_placement(
    name: str, cfg: EngramConfig, hasher: NgramHasher, device: torch.device, dtype: torch.dtype, **kwargs
) -> EngramPlacement:
    """The placement `name` (`--engram-placement`) over the tables of `cfg`."""
    if name not in PLACEMENTS:
        raise ValueError(f"unknown Engram placement {name!r} ({' | '.join(PLACEMENTS)})")
    return PLACEMENTS[name](cfg, hasher, device, dtype, **kwargs)


class EngramRuntime:
    def __init__(
        self, hasher: NgramHasher, placement: EngramPlacement, opts: EngramOptions, rows: int
    ) -> None:
        """`rows`: request rows of the worker's tables (the device hashing keeps a history per row)."""
        self.hasher, self.placement, self.opts = hasher, placement, opts
        self.on_device = (
            DeviceHasher(hasher, rows, placement.device) if placement.device_table is not None else None
        )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-lookup")
        # per request row, where its last sampled token lands on the host: (tokens, index, copy event)
        self._last: dict[int, tuple[torch.Tensor, int, torch.cuda.Event | None]] = {}
        self._side: torch.cuda.Stream | None = None  # the device lookup's stream (`_device_rows`)

    @classmethod
    def create(
        cls,
        hasher: NgramHasher | None,
        opts: EngramOptions,
        device: torch.device,
        dtype: torch.dtype,
        rows: int,
        split_group=None,  # noqa: ANN001 (`split`: the ProcessGroup to shard over; None: this process alone)
    ) -> EngramRuntime | None:
        if hasher is None:
            return None
        kwargs = {"shards": opts.shards, "mapped": opts.mapped} if opts.placement == "host" else {}
        if opts.placement == "split":
            kwargs = {"group": split_group or split_group_of(0, 1, 1)}
        placement = make_placement(opts.placement, hasher.cfg, hasher, device, dtype, **kwargs)
        return cls(hasher, placement, opts, rows)

    @property
    def wants_addresses(self) -> bool:
        """Plans carry the scheduler's addresses (`StepPlan.engram_addr`): lookups hashed on the host."""
        return self.on_device is None

    def begin(self, plan: StepPlan) -> None:
        """Every plan, before its forward (eager or graph): fail a step while rows are unreadable, and
        (device hashing) count its lookup and set the history of the requests entering rows."""
        if plan.rows:
            self.placement.check()
        if self.on_device is None:
            return
        if plan.rows:
            self.placement.stats.lookups += 1
            self.placement.stats.rows += sum(plan.extend_lens) * self.hasher.columns
        first = dict(zip(plan.rows, plan.prefix_lens, strict=True))
        seqs = [[*s.prompt_ids, *s.output_ids] for s in plan.added]
        # the next token a request processes: its first in this step, else (no step yet) past its prefix
        starts = [first.get(s.row, len(s.prefix_slots)) for s in plan.added]
        self.on_device.set_history([s.row for s in plan.added], seqs, starts)

    def graph_rows(self, batch: ForwardBatch) -> EngramRows:
        """A decode graph's rows (every row one token; padding rows are row 0's), read on the device."""
        b = batch.rows.shape[0]
        idx = torch.arange(b, device=batch.rows.device)
        return self._device_rows(batch, torch.zeros_like(idx), idx, idx)

    def _device_rows(
        self, batch: ForwardBatch, offsets: torch.Tensor, owner: torch.Tensor, last: torch.Tensor
    ) -> EngramRows:
        """Hash and gather on a side stream that forks from the step's stream here and joins it where
        the first Engram layer reads: the lookup (PCIe reads, for a mapped host table) runs beside the
        layers below that one instead of before them. A CUDA graph captures the fork and the join.
        Memory: the step's inputs the side stream reads stay referenced until the join (freed earlier,
        the step's stream could reuse them under the side stream's reads), and what the side stream
        allocates is reused only after the next fork, which waits for the step's stream."""
        table = self.placement.device_table
        main = side = None
        if table.device.type == "cuda":  # a mapped host table is a CUDA tensor too
            main, side = torch.cuda.current_stream(self.placement.device), self._side_stream()
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            addr = self.on_device.addresses(batch.input_ids, batch.rows, offsets, owner, last)
            words = wide_rows(table).index_select(0, addr.view(-1))
            rows = words.view(table.dtype).view(*addr.shape, table.shape[1])

        inputs = (batch.input_ids, batch.rows, offsets, owner, last)

        def wait() -> torch.Tensor:
            nonlocal inputs
            if side is not None:
                main.wait_stream(side)
            inputs = None
            return rows

        return EngramRows(self.hasher, wait, self.placement.stats)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.placement.device)
        return self._side

    @property
    def stats(self):  # noqa: ANN201
        return self.placement.stats

    def counters(self) -> EngramCounters:
        s = self.placement.stats
        restarts = getattr(self.placement, "restarts", 0)
        return EngramCounters(s.lookups, s.rows, s.fetch_s, s.wait_s, restarts)

    def addresses(self, plan: StepPlan) -> np.ndarray:
        t = sum(plan.extend_lens)
        if plan.engram_addr:
            # one small copy (8 bytes per row fetched) into writable memory, which torch wants
            addr = np.frombuffer(bytearray(plan.engram_addr), dtype="<i8")
            return addr.reshape(t, self.hasher.columns)
        # plans made outside a scheduler (tools): whole prompts from position 0 only. Warm-up steps
        # (step -1, gpu/warm_up.py) run made-up tokens after made-up prefixes: hashing each row's new
        # tokens alone gives addresses as good as any for them
        if plan.step >= 0 and (any(plan.use_last) or any(plan.prefix_lens)):
            raise ValueError("an Engram model's step plan needs the scheduler's addresses (engram_addr)")
        ids, parts, off = plan.input_ids, [], 0
        for n in plan.extend_lens:
            parts.append(self.hasher.addresses(ids[off : off + n], 0, n))
            off += n
        return np.concatenate(parts) if parts else np.zeros((0, self.hasher.columns), dtype=np.int64)

    def sampled(self, rows: list[int], tokens: torch.Tensor) -> None:
        """`tokens` [rows, k] (a host tensor, its copy maybe still in flight) holds what `rows` just
        sampled: the next step's decode rows complete their addresses with it (host hashing only)."""
        if self.on_device is not None:
            return
        ready = None
        if tokens.device.type == "cpu" and self.placement.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for i, row in enumerate(rows):
            self._last[row] = (tokens, i, ready)

    def start(self, plan: StepPlan, batch: ForwardBatch) -> EngramRows:
        """An eager step's rows: read on the device, or fetched on the lookup thread."""
        if self.on_device is not None:
            ext = np.asarray(plan.extend_lens)
            ends = np.cumsum(ext)
            offsets = np.arange(ends[-1]) - np.repeat(ends - ext, ext)
            cols = np.concatenate([offsets, np.repeat(np.arange(len(ext)), ext), ends - 1])
            cols = torch.from_numpy(cols).to(batch.rows.device, non_blocking=True)
            t = int(ends[-1])
            return self._device_rows(batch, cols[:t], cols[t : 2 * t], cols[2 * t :])
        addr = self.addresses(plan)
        placement, delay = self.placement, self.opts.lookup_delay_s
        placement.stats.lookups += 1
        placement.stats.rows += addr.size
        # decode rows (one token each, fed from the device): the scheduler sent partial hashes
        # Each row's record is used once: a step that fails leaves none, so a decode of the same row
        # planned behind it (overlap) fails too instead of reading a stale token.
        starts = np.cumsum([0, *plan.extend_lens[:-1]])
        for row in plan.released:
            self._last.pop(row, None)
        fed = []
        for s, row, u in zip(starts, plan.rows, plan.use_last, strict=True):
            last = self._last.pop(row, None)
            if u:
                if last is None:
                    raise StepFailed(
                        f"Engram: row {row}'s previous step failed, so its input token is unknown"
                    )
                fed.append((int(s), last))

        def fetch() -> torch.Tensor:
            t0 = time.perf_counter()
            if fed:  # wait for the step in flight's tokens, then finish these rows' hashes
                for _, (_, _, ready) in fed:
                    if ready is not None:
                        ready.synchronize()
                idx = np.array([i for i, _ in fed])
                tokens = np.array([int(t[j, 0]) for _, (t, j, _) in fed], dtype=np.int64)
                addr[idx] = self.hasher.complete(addr[idx], tokens)
            if delay:
                time.sleep(delay)
            out = placement.fetch(addr)()
            placement.stats.fetch_s += time.perf_counter() - t0
            return out

        if self.opts.prefetch:
            fut = self._pool.submit(fetch)
            return EngramRows(self.hasher, fut.result, placement.stats)
        return EngramRows(self.hasher, fetch, placement.stats)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.placement.close()


def make_engram_runtime(
    cfg: RunnerConfig, model_path: Path, device: torch.device, dtype: torch.dtype
) -> EngramRuntime | None:
    """The runner's Engram runtime when the model's config has an Engram block, else None."""
    from runtime.engram.addresses import hasher_for_model
    from runtime.model_info import tokenizer_dir

    path = str(model_path)
    hasher = hasher_for_model(
        path, lambda: tokenizer_dir(cfg.tokenizer, path, cfg.load_format), cfg.hf_overrides
    )
    if hasher is None:
        return None
    opts = cfg.engram or EngramOptions()
    group = split_group_of(cfg.rank, cfg.world_size, cfg.tp_size) if opts.placement == "split" else None
    return EngramRuntime.create(hasher, opts, device, dtype, cfg.max_reqs + 1, split_group=group)


def split_group_of(rank: int, world_size: int, tp_size: int):  # noqa: ANN201
    """The process group `split` shards over: this rank's attention group (its `tp_size` ranks step the
    same tokens, so each reads the rows it owns of the same addresses), as a group of its own. The
    lookup thread's all-reduce runs while the model's own collectives do, and two threads' collectives
    on one group would interleave in a different order on each rank. Every rank makes every group, in
    the same order (torch.distributed's rule). One engine: a one-rank gloo group of this process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD
    return own_group(rank, world_size, tp_size, backend=dist.get_backend())

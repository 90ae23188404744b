"""Where Engram tables live: one base class, chosen by `--engram-placement` from the registry in
`runtime/engram/runtime.py`:

- `device`: the whole table on each GPU (small tables); a lookup is one index_select.
- `host`: rows in a shared-memory table whose row ranges EngramShardActor processes fill and serve: on
  CUDA the worker maps it and the GPU reads rows straight from host memory; on the CPU (or unmapped)
  lookups go to the shards over the mailbox transport (`runtime/engram/host.py`).
- `split`: rows sharded across the ranks of a torch.distributed group; each rank reads the rows it owns
  and the group sums the partial results (one owner per row, the rest add exact zeros).

Every placement returns the same rows, so outputs are identical whichever is chosen. A placement whose
table the step's device reads directly (`device_table`: `device`, mapped `host`) is read inside the step,
addresses hashed on the device (`device_hash.py`), so decode steps run as CUDA graphs. The others start
a lookup when the step's addresses are known (`start`), and the first Engram layer that reads it waits
(`EngramRows.rows`), so the fetch overlaps the layers below."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from runtime.engram.config import EngramConfig
from runtime.engram.hashing import NgramHasher
from runtime.engram.tables import load_rows, shard_ranges


class EngramStats:
    """Counters for /metrics: lookups, rows fetched, fetch time, time the forward waited for rows."""

    def __init__(self) -> None:
        self.lookups = 0
        self.rows = 0
        self.fetch_s = 0.0
        self.wait_s = 0.0


class EngramRows:
    """One step's lookup: `rows(layer)` is [T, (N - 1) * n_embed] for that layer, waiting on the fetch
    the first time a layer asks."""

    def __init__(self, hasher: NgramHasher, wait: Callable[[], torch.Tensor], stats: EngramStats) -> None:
        self.hasher, self._wait, self.stats = hasher, wait, stats
        self._rows: torch.Tensor | None = None

    def rows(self, layer: int) -> torch.Tensor:
        if self._rows is None:
            t0 = time.perf_counter()
            self._rows = self._wait()
            self.stats.wait_s += time.perf_counter() - t0
        cfg = self.hasher.cfg
        i, h = cfg.layer_ids.index(layer), cfg.heads_per_layer
        return self._rows[:, i * h : (i + 1) * h].flatten(1)


class EngramPlacement(ABC):
    name: str

    def __init__(
        self, cfg: EngramConfig, hasher: NgramHasher, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg, self.hasher, self.device, self.dtype = cfg, hasher, device, dtype
        self.stats = EngramStats()

    @abstractmethod
    def fetch(self, addresses: np.ndarray) -> Callable[[], torch.Tensor]:
        """Start fetching rows [T, columns] of global addresses; the callable waits and returns them as
        [T, columns, head_dim] on the device in the model's dtype."""

    @property
    def device_table(self) -> torch.Tensor | None:
        """The whole table [rows, head_dim] as a tensor the step's device reads rows of with an index,
        without a host hop (None: lookups go through `fetch`)."""
        return None

    def check(self) -> None:  # noqa: B027 (optional hook)
        """Raise StepFailed when rows cannot be read now (a crashed host shard); nothing by default."""

    def start(self, addresses: np.ndarray) -> EngramRows:
        """The rows of `addresses`, fetched now and waited for when a layer asks (tests and tools; the
        worker goes through `EngramRuntime`, which fetches on its lookup thread)."""
        self.stats.lookups += 1
        self.stats.rows += addresses.size
        return EngramRows(self.hasher, self.fetch(addresses), self.stats)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release processes and memory (nothing by default)."""


class DevicePlacement(EngramPlacement):
    name = "device"

    def __init__(
        self, cfg: EngramConfig, hasher: NgramHasher, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__(cfg, hasher, device, dtype)
        self.table = load_rows(cfg, hasher.layer_ranges, 0, hasher.total_rows, dtype).to(device)

    @property
    def device_table(self) -> torch.Tensor:
        return self.table

    def fetch(self, addresses: np.ndarray) -> Callable[[], torch.Tensor]:
        idx = torch.from_numpy(addresses).to(self.device, non_blocking=True)
        out = self.table[idx]
        return lambda: out


class SplitPlacement(EngramPlacement):
    """Rows sharded over `group` (this rank's range: `shard_ranges(total, group size)[rank]`)."""

    name = "split"

    def __init__(
        self,
        cfg: EngramConfig,
        hasher: NgramHasher,
        device: torch.device,
        dtype: torch.dtype,
        group=None,  # noqa: ANN001 (a torch.distributed ProcessGroup; None: the default group)
    ) -> None:
        import torch.distributed as dist

        super().__init__(cfg, hasher, device, dtype)
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.lo, self.hi = shard_ranges(hasher.total_rows, size)[rank]
        self.table = load_rows(cfg, hasher.layer_ranges, self.lo, self.hi, dtype).to(device)

    def fetch(self, addresses: np.ndarray) -> Callable[[], torch.Tensor]:
        import torch.distributed as dist

        idx = torch.from_numpy(addresses).to(self.device)
        mine = (idx >= self.lo) & (idx < self.hi)
        local = self.table[(idx - self.lo).clamp(0, max(self.hi - self.lo - 1, 0))]
        out = torch.where(mine[..., None], local, torch.zeros((), dtype=local.dtype, device=local.device))
        work = dist.all_reduce(out, group=self.group, async_op=True)

        def wait() -> torch.Tensor:
            work.wait()
            return out

        return wait

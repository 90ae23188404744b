"""Expert parallelism: the routed experts of a MoE layer split over the EP ranks, tokens sent to the
ranks that hold their experts and brought back weighted.

Placement is data (`ExpertPlacement`): `slots` lists, for each physical expert slot, the logical expert
it holds; rank r holds slots [r * S, (r + 1) * S) where S = slots per rank. More slots than experts are
redundant copies of hot experts; a token picks among an expert's copies by its index, which spreads a hot
expert's tokens over its copies. `rebalance` (EPLB) turns measured expert load into a new placement:
copies for the hottest experts, then slots packed onto ranks so each rank's load is even. Outputs do not
depend on the placement: every copy holds the same weights.

A layer's exchange (`ExpertParallelMoE.forward`) has DeepEP's two modes. Normal (prefill, and every
step on the CPU): each (token, chosen expert) pair goes to the rank of a slot holding that expert
(`all_to_all_single`, splits learned from a first exchange of counts, read on the host), runs
there through the local experts with its routing weight, comes back the same way and is summed into its
token. A rank with no tokens (an idle DP rank) still takes part with empty tensors, so the collectives
of every rank line up. Low latency (decode-sized steps on CUDA, and every step that replays or captures a
CUDA graph, whatever its size): blocks of a fixed number of rows per rank pair, the step's most tokens on
any rank times k, so nothing is read on the host and the exchange can be captured. A verify graph of
more than `LOW_LATENCY_MAX_TOKENS` tokens (bucket x (K + 1)) still takes fixed blocks; so does the idle
rank's step beside it (the ranks agreed on the graph, so they agree on the mode)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.gpu import distributed
from runtime.gpu.kernels.moe_exchange import MOE_EXCHANGE


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    ep_size: int
    slots: tuple[int, ...]  # physical slot -> logical expert

    def __post_init__(self) -> None:
        if len(self.slots) % self.ep_size:
            raise ValueError(f"{len(self.slots)} expert slots do not split over {self.ep_size} ranks")
        if sorted(set(self.slots)) != list(range(self.num_experts)):
            raise ValueError(f"the placement must hold each of the {self.num_experts} experts at least once")
        for r in range(self.ep_size):
            local = self.local(r)
            if len(set(local)) != len(local):
                raise ValueError(f"rank {r} holds an expert twice: {local}")

    @property
    def per_rank(self) -> int:
        return len(self.slots) // self.ep_size

    def local(self, rank: int) -> list[int]:
        """The logical experts rank `rank` holds, in its local order."""
        return list(self.slots[rank * self.per_rank : (rank + 1) * self.per_rank])

    def copies(self) -> list[list[int]]:
        """Each logical expert's physical slots."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slots):
            out[e].append(slot)
        return out

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int, redundant: int = 0) -> ExpertPlacement:
        """Experts in rank order; with `redundant` extra slots, EPLB's placement for an even load (copies
        of experts 0, 1, ..., each on a rank that lacks it)."""
        if (num_experts + redundant) % ep_size:
            raise ValueError(f"{num_experts} experts + {redundant} copies do not split over {ep_size} ranks")
        if redundant == 0:
            return cls(num_experts, ep_size, tuple(range(num_experts)))
        return rebalance([1.0] * num_experts, ep_size, num_experts + redundant)

    def to_json(self) -> str:
        return json.dumps(
            {"num_experts": self.num_experts, "ep_size": self.ep_size, "slots": list(self.slots)}
        )

    @classmethod
    def from_json(cls, text: str) -> ExpertPlacement:
        d = json.loads(text)
        return cls(d["num_experts"], d["ep_size"], tuple(d["slots"]))

    @classmethod
    def load(cls, path: str | Path) -> ExpertPlacement:
        return cls.from_json(Path(path).read_text())


def rebalance(load: Sequence[float], ep_size: int, num_slots: int) -> ExpertPlacement:
    """EPLB: a placement of `len(load)` experts in `num_slots` slots over `ep_size` ranks from measured
    load (tokens routed to each expert). Each slot beyond one per expert copies the expert with the most
    load per copy; then copies, heaviest first, go to the least-loaded rank with a free slot that does not
    hold that expert yet."""
    n = len(load)
    if num_slots < n or num_slots % ep_size:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts evenly over {ep_size} ranks")
    per_rank = num_slots // ep_size
    if num_slots - n > n * (ep_size - 1):
        raise ValueError("more redundant slots than ranks to hold the copies")
    copies = [1] * n
    for _ in range(num_slots - n):
        hot = max((e for e in range(n) if copies[e] < ep_size), key=lambda e: load[e] / copies[e])
        copies[hot] += 1
    items = sorted(
        ((load[e] / copies[e], e) for e in range(n) for _ in range(copies[e])), key=lambda t: -t[0]
    )
    rank_load, ranks = [0.0] * ep_size, [[] for _ in range(ep_size)]
    for share, e in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < per_rank and e not in ranks[r]]
        r = min(free, key=lambda r: (rank_load[r], r))
        ranks[r].append(e)
        rank_load[r] += share
    return ExpertPlacement(n, ep_size, tuple(e for r in ranks for e in sorted(r)))


LOW_LATENCY_MAX_TOKENS = 256


class ExchangeClock:
    """Seconds spent in the exchanges' all-to-alls while `timed_exchanges` is on (device synced around
    each call: for a measuring step of its own, never a timed one)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


_clock: ExchangeClock | None = None


@contextlib.contextmanager
def timed_exchanges() -> Iterator[ExchangeClock]:
    global _clock
    _clock = clock = ExchangeClock()
    try:
        yield clock
    finally:
        _clock = None


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """`distributed.all_to_all` over the EP group, timed while `timed_exchanges` is on."""
    if _clock is None:
        return distributed.all_to_all(x, out_splits, in_splits)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t = time.perf_counter()
    out = distributed.all_to_all(x, out_splits, in_splits)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    _clock.seconds += time.perf_counter() - t
    _clock.calls += 1
    return out


class ExpertParallelMoE(torch.nn.Module):
    """Dispatch, local experts, combine, over the EP group. `experts` is the rank's `RoutedExperts`,
    holding `placement.local(rank)` in order. Counts tokens per logical expert (`load`) for EPLB."""

    def __init__(self, placement: ExpertPlacement) -> None:
        super().__init__()
        self.placement = placement
        self._identity = placement.slots == tuple(range(placement.num_experts))  # slot e holds expert e
        # built on first use on the activations' device (the model is built on the meta device, then
        # moved empty: buffers made here would hold nothing)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.load: torch.Tensor | None = None  # tokens routed to each logical expert, for `rebalance`
        self.count_load = _count_load  # only when someone reads `load` (`--expert-load-out`): two ops a layer
        self.mode = "auto"  # "auto" | "normal" | "low_latency" (module docstring; tests pin one)
        # the step's largest token count over the EP ranks (DP ranks agree on it before each step), so
        # every rank picks the same mode and block size; None: this rank's own count (one rank)
        self.step_tokens: int | None = None
        # the step replays (or captures) a CUDA graph, on every rank: fixed blocks whatever the size
        self.graphed = False

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            copies = self.placement.copies()
            width = max(len(c) for c in copies)
            table = torch.tensor([c + [c[0]] * (width - len(c)) for c in copies], dtype=torch.int64)
            counts = torch.tensor([len(c) for c in copies], dtype=torch.int64)
            self._tables = table.to(device), counts.to(device)
            self.load = torch.zeros(self.placement.num_experts, dtype=torch.int64, device=device)
        return self._tables

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] logical experts -> [T, k] physical slots: a copy per pair, by its token. A decode
        step's layer pays for every op here: none when slot e holds expert e, one gather when every
        expert has one copy."""
        copy_table, num_copies = self._tables_on(ids.device)
        if self._identity:
            return ids
        if copy_table.shape[1] == 1:
            return copy_table[:, 0][ids]
        t, k = ids.shape
        flat = ids.reshape(-1)
        token = torch.arange(t * k, device=ids.device) // k
        return copy_table[flat, token % num_copies[flat]].view(t, k)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:  # noqa: ANN001
        """x: [T, D], weights/ids: [T, k] (logical experts) -> [T, D]: sum_k weights * expert(x)."""
        t = ids.shape[0]
        slots = self._slots(ids)
        if self.count_load:
            flat = ids.reshape(-1)
            self.load.index_add_(0, flat, torch.ones_like(flat))
        most = self.step_tokens if self.step_tokens is not None else t
        low_latency = self.mode == "low_latency" or (
            self.mode == "auto" and (self.graphed or (x.is_cuda and most <= LOW_LATENCY_MAX_TOKENS))
        )
        exchange = MOE_EXCHANGE.get(x.device)
        return exchange(x, weights, slots, self.placement.per_rank, experts, most, low_latency)


@contextlib.contextmanager
def graphed(exchanges: Sequence[ExpertParallelMoE], tokens: int | None = None) -> Iterator[None]:
    """Around a CUDA graph step's forward (captured, or its padded path run eagerly off CUDA): its
    exchanges take fixed blocks whatever their size, since capture bakes the mode in; with `tokens`, of
    that many rows a rank (the bucket's: DP ranks in lockstep replay one agreed bucket)."""
    before = [m.graphed for m in exchanges]
    for m in exchanges:
        m.graphed = True
        if tokens is not None:
            m.step_tokens = tokens
    try:
        yield
    finally:
        for m, was in zip(exchanges, before, strict=True):
            m.graphed = was


_placement: ExpertPlacement | None = None  # set by the runner before the model is built (`use`)
_redundant = 0
_always = False
_count_load = False


def use(
    placement: ExpertPlacement | None, redundant: int = 0, always: bool = False, count_load: bool = False
) -> None:
    """The placement the next model built on this rank takes (None: `ExpertPlacement.contiguous` with
    `redundant` extra slots); `always`: the exchange even on one rank (`--moe-a2a-backend all_to_all`,
    to measure what the EP path costs against the plain fused MoE); `count_load`: its layers count the
    tokens routed to each expert (`ExpertParallelMoE.load`, for EPLB)."""
    global _placement, _redundant, _always, _count_load
    _placement, _redundant, _always, _count_load = placement, redundant, always, count_load


def for_rank(num_experts: int) -> ExpertParallelMoE | None:
    """The exchange of a MoE layer of `num_experts` experts on this rank; None without EP."""
    group = distributed.ep()
    if group.size == 1 and not _always:
        return None
    p = _placement or ExpertPlacement.contiguous(num_experts, group.size, _redundant)
    if (p.num_experts, p.ep_size) != (num_experts, group.size):
        raise ValueError(
            f"the expert placement is for {p.num_experts} experts on {p.ep_size} ranks, the model has "
            f"{num_experts} experts on {group.size}"
        )
    return ExpertParallelMoE(p)


def measured_load(directory: str | Path) -> list[int]:
    """The expert load the ranks of a server wrote with `--expert-load-out`, summed over ranks."""
    files = sorted(Path(directory).glob("expert_load.rank*.json"))
    if not files:
        raise FileNotFoundError(f"no expert_load.rank*.json in {directory}")
    loads = [json.loads(f.read_text()) for f in files]
    return [sum(col) for col in zip(*loads, strict=True)]


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.gpu.layers.expert_parallel LOAD_DIR --ep-size N --slots M`: the EPLB placement
    for the measured load, as JSON on stdout (for --expert-placement)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("load_dir")
    p.add_argument("--ep-size", type=int, required=True)
    p.add_argument("--slots", type=int, help="physical expert slots (default: one per expert)")
    a = p.parse_args(argv)
    load = measured_load(a.load_dir)
    print(rebalance(load, a.ep_size, a.slots or len(load)).to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

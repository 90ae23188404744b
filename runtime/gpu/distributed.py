"""The ranks of one engine and their process groups (torch.distributed: NCCL on CUDA, gloo on the CPU).

One engine process per rank. `init` joins the world once, before the model is built; the model's
parallel layers (`runtime/gpu/layers/parallel.py`) read this rank's place from `tp()` while they are
constructed, as SGLang's parallel state does. Without `init` (world size 1) every accessor answers for a
single rank and every collective is the identity, so one engine runs the same code as many.

Groups: tensor parallelism (TP) splits the dense layers over the `tp_size` ranks of a group; the world
holds `world_size // tp_size` such groups (with DP attention, one per DP rank). Expert parallelism (EP)
splits the routed experts over the whole world."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Group:
    """This rank's place in one process group; `handle` is None for a group of one."""

    rank: int = 0
    size: int = 1
    handle: object | None = None


_TP = Group()
_WORLD = Group()
_EP = Group()  # the ranks the routed experts split over (DeepSeek MoE under --ep-size)
_CPU = Group()  # the world over gloo, for host-side agreement (the DP ranks' step flags) beside NCCL


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(
    rank: int, world_size: int, tp_size: int, init_addr: str, device: torch.device, ep_size: int = 1
) -> None:
    """Join the world of `world_size` ranks at `init_addr` ("host:port", rank 0 listens there) and make
    the TP groups, the EP group (the world, when `ep_size` > 1) and a gloo group for host-side flags.
    Blocks until every rank joined. Nothing for a world of one."""
    global _TP, _WORLD, _EP, _CPU
    if world_size == 1:
        return
    if ep_size not in (1, world_size):
        raise ValueError(f"--ep-size {ep_size} must be 1 or the world size {world_size}")
    if world_size % tp_size:
        raise ValueError(f"world size {world_size} is not a multiple of --tp-size {tp_size}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://{init_addr}", rank=rank, world_size=world_size
    )
    _WORLD = Group(rank, world_size, dist.group.WORLD)
    tp_handle = own_group(rank, world_size, tp_size) if tp_size < world_size else dist.group.WORLD
    _TP = Group(rank % tp_size, tp_size, tp_handle if tp_size > 1 else None)
    if ep_size > 1:
        _EP = Group(rank, world_size, dist.group.WORLD)
    cpu = dist.group.WORLD if device.type != "cuda" else dist.new_group(backend="gloo")
    _CPU = Group(rank, world_size, cpu)
    log.info(
        "distributed_ready", rank=rank, world_size=world_size, tp_size=tp_size, backend=backend_for(device)
    )


def own_group(rank: int, world_size: int, size: int, backend: str | None = None):  # noqa: ANN201
    """The world cut into consecutive groups of `size` ranks, each a new process group; returns the
    handle of the one `rank` is in. Every rank creates every group, in the same order (torch.distributed's
    rule), so every rank calls this with the same arguments."""
    mine = None
    for first in range(0, world_size, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def tp() -> Group:
    return _TP


def world() -> Group:
    return _WORLD


def ep() -> Group:
    return _EP


def cpu_group() -> Group:
    return _CPU


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Group | None = None
) -> torch.Tensor:
    """Rows of `x` sent to the ranks in order (`in_splits[r]` rows to rank r); returns the rows every
    rank sent here, in rank order (`out_splits[r]` from rank r). `all_to_all_single` on NCCL or gloo."""
    group = group or _EP
    if group.size == 1:
        return x
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.handle)
    return out


def all_reduce(x: torch.Tensor, group: Group | None = None, op: str = "sum") -> torch.Tensor:
    """`x` summed (or min/max) over the group, in place; the identity for a group of one."""
    group = group or _TP
    if group.size > 1:
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op.upper()), group=group.handle)
    return x


def all_gather(x: torch.Tensor, dim: int = -1, group: Group | None = None) -> torch.Tensor:
    """Each rank's `x` (equal shapes) concatenated along `dim` in rank order."""
    group = group or _TP
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.handle)
    return torch.cat(parts, dim=dim)


def world_min(n: int, device: torch.device) -> int:
    """The least of every rank's `n` (ranks agree on a size each measured, such as the KV pool's)."""
    if _WORLD.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_max(*values: int) -> list[int]:
    """The largest of every rank's value, for each of `values`, over the gloo group (host values: no
    device sync)."""
    if _CPU.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CPU.handle)
    return t.tolist()


def shutdown() -> None:
    global _TP, _WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP, _WORLD, _EP, _CPU = Group(), Group(), Group(), Group()

"""Running a function on several CPU ranks (gloo) for multi-rank tests: `run_ranks(fn, world, *args)`
starts `world` fresh processes (spawn), each joining one world at a free loopback port, and raises if any
rank failed. `fn(rank, world, *args)` must be importable (a module-level function). With `join=False`
the ranks do not join the world themselves: `fn(rank, world, addr, *args)` gets the address, for code
that joins it on its own (a ModelRunner of world_size > 1)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world: int, addr: str, errors, args: tuple, join: bool) -> None:  # noqa: ANN001
    import torch

    from runtime.gpu import distributed

    torch.set_num_threads(1)
    try:
        if join:
            distributed.init(rank, world, 1, addr, torch.device("cpu"), ep_size=world)
            fn(rank, world, *args)
        else:
            fn(rank, world, addr, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        distributed.shutdown()


def run_ranks(fn: Callable, world: int, *args, timeout: float = 120.0, join: bool = True) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    addr = f"127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world, addr, errors, args, join)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    if alive:
        failures.append(f"{len(alive)} ranks did not finish in {timeout} s")
    if failures:
        raise AssertionError("\n".join(failures))

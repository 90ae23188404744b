"""An engine process of the default placement: one rank's GPU worker, and its DP group's scheduler when
the rank leads one."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import traceback
from pathlib import Path

import msgspec
import structlog

from runtime.actors import addresses
from runtime.actors.system import ActorSystem
from runtime.config import RunnerConfig, ServerConfig
from runtime.mailbox.messages import NodeFailed, NodeReady

log = structlog.get_logger(__name__)


async def spawn_engine_actors(
    system: ActorSystem,
    cfg: ServerConfig,
    model_path: str,
    max_model_len: int,
    rank: int = 0,
    world_size: int = 1,
    dist_init_addr: str | None = None,
) -> None:
    """Start rank `rank`'s actors in `system` (shared by every placement): the scheduler first (when this
    rank leads its DP group), which waits for its worker's capabilities, then the worker, which loads the
    model and reports them. Returns once the scheduler is configured. The group's scheduler sends every
    plan to each of the group's workers (tensor parallelism: they run it together); its leader's worker
    reports."""
    from runtime.actors.gpu_worker import GpuWorkerActor
    from runtime.actors.scheduler.actor import SchedulerActor
    from runtime.disaggregation.config import DisaggConfig

    disagg = DisaggConfig.from_server(cfg)
    if disagg is not None and (world_size > 1 or cfg.speculative_algorithm):
        raise ValueError("--disaggregation-mode runs on one rank without speculative decoding (for now)")
    dp_size = dp_groups(cfg, world_size)
    dp_rank, leads = addresses.dp_group(rank, world_size, dp_size)
    scheduler = None
    if leads:
        group = world_size // dp_size
        workers = [addresses.worker(r) for r in range(rank, rank + group)]
        stats_to = addresses.DP_CONTROLLER if dp_size > 1 else addresses.CLIENT
        scheduler = await system.spawn(SchedulerActor(cfg, dp_rank, workers, stats_to))
    runner_cfg = RunnerConfig.resolve(cfg, model_path, max_model_len, rank, world_size, dist_init_addr)
    lockstep = dp_size > 1  # DP attention: each rank plans alone, the MoE exchanges need them all
    worker = GpuWorkerActor(
        runner_cfg, rank=rank, scheduler=addresses.scheduler(dp_rank), reports=leads, lockstep=lockstep,
        disagg=disagg,
    )  # fmt: skip
    await system.spawn(worker)
    if scheduler is not None:
        await scheduler.configured.wait()


def dp_groups(cfg: ServerConfig, world_size: int) -> int:
    """Schedulers of the engine: one per DP-attention group, else one for the whole world."""
    return cfg.dp_size if cfg.enable_dp_attention and world_size > 1 else 1


class EngineArgs(msgspec.Struct):
    """What the parent hands the engine process on its stdin."""

    cfg: ServerConfig
    placement: dict[str, str]
    sock_dir: str
    model_path: str
    max_model_len: int
    parent_node: str
    rank: int = 0
    world_size: int = 1
    dist_init_addr: str | None = None
    # with several machines: TCP addresses of the frontend and of this rank (runtime/actors/nodes.py)
    node_addrs: dict[str, str] = {}


def main() -> None:
    # The frontend stops this process (a Shutdown message, then SIGTERM); a Ctrl-C meant for the
    # frontend must not kill it mid-stream with a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import uvloop

    from runtime.logging import setup_logging

    setup_logging()
    uvloop.run(_engine(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineArgs)))


async def _engine(a: EngineArgs) -> None:
    node = addresses.engine_node(a.rank)
    system = ActorSystem(node, a.placement, Path(a.sock_dir), a.node_addrs)
    await system.listen()
    try:
        await spawn_engine_actors(
            system, a.cfg, a.model_path, a.max_model_len, a.rank, a.world_size, a.dist_init_addr
        )
    except Exception as exc:
        log.error("engine_start_failed", rank=a.rank, error=str(exc), trace=traceback.format_exc())
        await system.send_to_node(
            a.parent_node, addresses.SYSTEM, NodeFailed(node, f"{type(exc).__name__}: {exc}")
        )
        await asyncio.sleep(0.2)  # let the frame leave before the process exits
        return
    # what start-up made (modules, the model) lives as long as the process: the collector's full passes,
    # while serving and the one at exit (2-3 s on the CPU), skip it
    gc.freeze()
    info = {"addr": a.node_addrs[node]} if node in a.node_addrs else {}
    await system.send_to_node(a.parent_node, addresses.SYSTEM, NodeReady(node, info))
    parent = os.getppid()
    while not system.shutdown_requested.is_set():
        try:
            await asyncio.wait_for(system.shutdown_requested.wait(), 1.0)
        except TimeoutError:
            if os.getppid() != parent:  # orphaned: the frontend died without telling us
                break
    await system.stop()


if __name__ == "__main__":
    main()

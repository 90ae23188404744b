"""The engine process of the default placement: the scheduler and the GPU worker of one rank."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import traceback
from pathlib import Path

import msgspec
import structlog

from runtime.actors.system import ActorSystem
from runtime.config import ServerConfig
from runtime.mailbox.messages import NodeFailed, NodeReady

log = structlog.get_logger(__name__)


async def spawn_engine_actors(
    system: ActorSystem, cfg: ServerConfig, model_path: str, max_model_len: int
) -> None:
    """Start the worker (loads the model) and the scheduler in `system`. Shared by every placement."""
    from runtime.actors.gpu_worker import GpuWorkerActor
    from runtime.actors.scheduler.actor import SchedulerActor
    from runtime.gpu.model_runner import RunnerConfig

    slots = cfg.resolved_kv_slots()
    runner_cfg = RunnerConfig(
        model_path=model_path,
        device=cfg.device,
        dtype=cfg.resolved_dtype(),
        kv_cache_dtype=cfg.kv_cache_dtype,
        quantization=cfg.quantization,
        load_format=cfg.load_format,
        num_kv_slots=slots,
        max_reqs=cfg.max_running_requests,
        max_model_len=max_model_len,
        page_size=cfg.page_size,
        seed=cfg.seed,
        attention_backend=cfg.attention_backend,
        cuda_graph=not cfg.disable_cuda_graph,
        cuda_graph_max_bs=cfg.cuda_graph_max_bs,
        swa_replay_tokens=cfg.swa_replay_tokens,
        swa_replay_exact=cfg.swa_replay_exact,
        hf_overrides=cfg.hf_overrides,
        max_prefill_tokens=cfg.resolved_chunked_prefill_size(),
    )
    worker = await system.spawn(GpuWorkerActor(runner_cfg))
    multiple = getattr(worker.runner, "page_multiple", 1)  # V4: pages hold whole compression windows
    if cfg.page_size % multiple:
        page_size = math.lcm(cfg.page_size, multiple)
        log.warning(
            "page_size_raised",
            requested=cfg.page_size,
            page_size=page_size,
            reason=f"the model's paged state needs pages of a multiple of {multiple} tokens",
        )
        cfg = msgspec.structs.replace(cfg, page_size=page_size)
    if not cfg.disable_radix_cache and not getattr(worker.runner, "supports_prefix_cache", True):
        log.warning(
            "radix_cache_disabled",
            reason="the model cannot reuse a cached prefix",
            model=type(worker.runner.model).__name__,
        )
        cfg = msgspec.structs.replace(cfg, disable_radix_cache=True)
    replay = getattr(worker.runner, "prefix_replay", 0)
    await system.spawn(SchedulerActor(cfg, slots, max_model_len, prefix_replay=replay))


class EngineArgs(msgspec.Struct):
    """What the parent hands the engine process on its stdin."""

    cfg: ServerConfig
    placement: dict[str, str]
    sock_dir: str
    model_path: str
    max_model_len: int
    parent_node: str


def main() -> None:
    import uvloop

    from runtime.logging import setup_logging

    setup_logging()
    a = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineArgs)
    uvloop.run(_engine(a.cfg, a.placement, Path(a.sock_dir), a.model_path, a.max_model_len, a.parent_node))


async def _engine(
    cfg: ServerConfig,
    placement: dict[str, str],
    sock_dir: Path,
    model_path: str,
    max_model_len: int,
    parent_node: str,
) -> None:
    system = ActorSystem("engine", placement, sock_dir)
    await system.listen()
    try:
        await spawn_engine_actors(system, cfg, model_path, max_model_len)
    except Exception as exc:
        log.error("engine_start_failed", error=str(exc), trace=traceback.format_exc())
        await system.send_to_node(parent_node, "system", NodeFailed("engine", f"{type(exc).__name__}: {exc}"))
        await asyncio.sleep(0.2)  # let the frame leave before the process exits
        return
    await system.send_to_node(parent_node, "system", NodeReady("engine"))
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

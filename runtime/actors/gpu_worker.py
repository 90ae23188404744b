"""The GPU worker actor of one rank: runs StepPlans on its model runner, off the event loop, strictly in
order.

At start-up it loads the runner and sends its `WorkerCapabilities` to its scheduler, which configures
itself from them. Two threads make overlap real on the device: the launch thread enqueues step N+1's
work as soon as its plan arrives, while the collect thread waits for step N's results (only N's copy,
not the device queue) and hands them back. So the GPU always has the next step queued behind the
running one, and the host work of planning, launching and output processing hides under device time.
Steps launch in arrival order and their outputs return in the same order, which is what makes overlap
scheduling safe."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgspec
import structlog

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.config import RunnerConfig
from runtime.errors import StepFailed
from runtime.mailbox.messages import (
    Message,
    StepAborted,
    StepOutput,
    StepPlan,
    WorkerCapabilities,
    WorkerFailed,
)

log = structlog.get_logger(__name__)


class PendingResult(Protocol):
    def result(self) -> StepOutput:
        """Wait for the launched step's results (and only for them)."""
        ...


class Runner(Protocol):
    """What the worker needs of a model runner (`runtime.gpu.model_runner.ModelRunner`; tests use fakes)."""

    def capabilities(self) -> WorkerCapabilities: ...

    def launch(self, plan: StepPlan) -> PendingResult: ...


def load_model_runner(cfg: RunnerConfig) -> Runner:
    from runtime.gpu.model_runner import ModelRunner  # torch is imported by engine processes only

    return ModelRunner(cfg)


class GpuWorkerActor(Actor):
    def __init__(
        self,
        runner_config: RunnerConfig | None,
        *,
        rank: int = 0,
        scheduler: str = addresses.scheduler(0),
        runner_factory: Callable[[RunnerConfig | None], Runner] = load_model_runner,
    ) -> None:
        super().__init__(addresses.worker(rank))
        self.runner_config = runner_config
        self.scheduler = scheduler
        self.runner_factory = runner_factory
        self.runner: Runner | None = None
        self._launch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-launch")
        self._collect = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-collect")
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._sender: asyncio.Task | None = None
        self.failed: str | None = None

    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._launch, self.runner_factory, self.runner_config)
        self._sender = asyncio.create_task(self._send_outputs(), name="worker-outputs")
        await self.send(self.scheduler, self.runner.capabilities())

    async def on_stop(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        self._launch.shutdown(wait=True)
        self._collect.shutdown(wait=True)

    async def handle(self, msg: Message) -> None:
        if not isinstance(msg, StepPlan) or self.failed:
            return
        loop = asyncio.get_running_loop()
        try:
            pending = await loop.run_in_executor(self._launch, self.runner.launch, msg)
        except StepFailed as exc:  # the device is fine: only this step's requests fail
            log.error("step_aborted", step=msg.step, error=str(exc))
            await self.send(self.scheduler, StepAborted(msg.step, str(exc)))
            return
        except Exception as exc:
            await self._fail(msg.step, exc)
            return
        await self._outputs.put((msg.step, loop.run_in_executor(self._collect, pending.result)))

    async def _send_outputs(self) -> None:
        while True:
            step, fut = await self._outputs.get()
            try:
                out = await fut
            except Exception as exc:
                await self._fail(step, exc)
                continue
            if not self.failed:
                engram = getattr(self.runner, "engram", None)
                if engram is not None:
                    out = msgspec.structs.replace(out, engram=engram.counters())
                await self.send(self.scheduler, out)

    async def _fail(self, step: int, exc: Exception) -> None:
        # a failed step leaves the device state unknown: fail everything, mark the engine unhealthy
        if self.failed:
            return
        self.failed = f"{type(exc).__name__}: {exc}"
        log.error("step_failed", step=step, error=self.failed, trace=traceback.format_exc())
        await self.send(self.scheduler, WorkerFailed(step, self.failed))

"""The GPU worker actor: runs each StepPlan on its model runner in one dedicated thread, so the event
loop stays free to receive the next plan (and the transport keeps flowing) while the device computes.
Steps run strictly in arrival order, which is what makes overlap scheduling safe."""

from __future__ import annotations

import asyncio
import traceback
from concurrent.futures import ThreadPoolExecutor

import structlog

from runtime.actors.base import Actor
from runtime.mailbox.messages import Message, StepPlan, WorkerFailed

log = structlog.get_logger(__name__)


class GpuWorkerActor(Actor):
    name = "worker"

    def __init__(self, runner_config) -> None:
        super().__init__()
        self.runner_config = runner_config
        self.runner = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-worker")
        self.failed: str | None = None

    async def on_start(self) -> None:
        from runtime.gpu.model_runner import ModelRunner

        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._thread, ModelRunner, self.runner_config)

    async def on_stop(self) -> None:
        self._thread.shutdown(wait=True)

    async def handle(self, msg: Message) -> None:
        if not isinstance(msg, StepPlan) or self.failed:
            return
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._thread, self.runner.execute, msg)
        except Exception as exc:
            # a failed step leaves the device state unknown: fail everything, mark the engine unhealthy
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("step_failed", step=msg.step, error=self.failed, trace=traceback.format_exc())
            await self.send("scheduler", WorkerFailed(msg.step, self.failed))
            return
        await self.send("scheduler", out)

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
import os
import queue
import signal
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import msgspec
import structlog

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.config import RunnerConfig
from runtime.errors import StepFailed
from runtime.mailbox.messages import (
    EngramCounters,
    KVCancel,
    KVReserve,
    Message,
    StepAborted,
    StepOutput,
    StepPlan,
    WorkerCapabilities,
    WorkerFailed,
)

if TYPE_CHECKING:
    from runtime.disaggregation.config import DisaggConfig

log = structlog.get_logger(__name__)

IDLE_POLL_MIN_S = 0.0005  # lockstep ranks, all idle: the first wait for a plan between agreements
IDLE_POLL_MAX_S = 0.02  # ... doubling up to this (the most an idle world adds to a request's start)


class PendingResult(Protocol):
    def result(self) -> StepOutput:
        """Wait for the launched step's results (and only for them)."""
        ...


class Runner(Protocol):
    """What the worker needs of a model runner (`runtime.gpu.model_runner.ModelRunner`; tests use fakes)."""

    device: object  # the runner's torch device (disaggregation's transfers stage through it)

    def capabilities(self) -> WorkerCapabilities: ...

    def launch(self, plan: StepPlan) -> PendingResult: ...

    def engram_counters(self) -> EngramCounters | None:
        """Cumulative Engram lookup figures, reported with each step's output (None: no Engram)."""
        ...

    def save_expert_load(self) -> None:
        """At shutdown: write the measured expert load where `--expert-load-out` asks (EPLB's input)."""
        ...

    # ranks that step together (DP attention with expert parallelism) also need:
    def set_step_tokens(self, n: int) -> None: ...

    def idle_step(self) -> None: ...


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
        reports: bool = True,
        lockstep: bool = False,
        disagg: DisaggConfig | None = None,
    ) -> None:
        super().__init__(addresses.worker(rank))
        self.runner_config = runner_config
        self.scheduler = scheduler
        self.runner_factory = runner_factory
        # The first rank of a tensor-parallel group speaks for it: every rank runs each plan (their
        # collectives meet), and the others' outputs, equal to its own, stay here. Failures all report.
        self.reports = reports
        # Data-parallel ranks with expert parallelism step together (`_lockstep`): every MoE layer's
        # exchange needs every rank, so a rank without a plan runs an idle step beside the others'.
        self.lockstep = lockstep
        self._plans: queue.Queue[StepPlan] = queue.Queue()
        self._stop_flag = False
        self.runner: Runner | None = None
        self._launch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-launch")
        self._collect = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-collect")
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._sender: asyncio.Task | None = None
        self.failed: str | None = None
        self.disagg = disagg  # prefill/decode disaggregation: this worker's side (runtime/disaggregation)
        self.prefill = self.decode = None

    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._launch, self.runner_factory, self.runner_config)
        self._sender = asyncio.create_task(self._send_outputs(), name="worker-outputs")
        if self.disagg is not None:
            await self._start_disaggregation()
        if self.reports:
            await self.send(self.scheduler, self.runner.capabilities())
        if self.lockstep:
            self._launch.submit(self._lockstep, loop)

    async def _start_disaggregation(self) -> None:
        from runtime.disaggregation.worker import DecodeSide, PrefillSide

        device = self.runner.device

        async def to_scheduler(msg: Message) -> None:
            await self.send(self.scheduler, msg)

        if self.disagg.mode == "prefill":
            self.prefill = PrefillSide(self.disagg, self.runner, to_scheduler, device)
        else:
            self.decode = DecodeSide(self.disagg, self.runner, to_scheduler, self._launch, device)
            await self.decode.start()

    async def on_stop(self) -> None:
        self._stop_flag = True
        for side in (self.prefill, self.decode):
            if side is not None:
                await side.stop()
        if self._sender is not None:
            self._sender.cancel()
        self._launch.shutdown(wait=True)
        self._collect.shutdown(wait=True)
        self.runner.save_expert_load()

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, (KVReserve, KVCancel)) and self.decode is not None and not self.failed:
            await self.decode.handle(msg)
            return
        if not isinstance(msg, StepPlan) or self.failed:
            return
        if self.lockstep:
            self._plans.put(msg)
            return
        loop = asyncio.get_running_loop()
        try:
            pending, exports = await loop.run_in_executor(self._launch, self._launch_step, msg)
        except StepFailed as exc:  # the device is fine: only this step's requests fail
            log.error("step_aborted", step=msg.step, error=str(exc))
            if self.reports:
                await self.send(self.scheduler, StepAborted(msg.step, str(exc)))
            return
        except Exception as exc:
            await self._fail(msg.step, exc)
            return
        await self._outputs.put((msg.step, loop.run_in_executor(self._collect, pending.result), exports))

    def _launch_step(self, plan: StepPlan) -> tuple[PendingResult, list]:
        """Launch the step; on a prefill server, also export the KV of the rows it finishes."""
        pending = self.runner.launch(plan)
        return pending, self.prefill.after_launch(plan) if self.prefill is not None else []

    def _lockstep(self, loop: asyncio.AbstractEventLoop) -> None:
        """The launch thread's loop for ranks that step together (runtime/gpu/lockstep.py). Each round
        the ranks agree whether any has a plan, on the most tokens any has and on the step's graph; if
        one has a plan, every rank steps: its own plan, or an idle step that joins the collectives with
        no tokens. While all are idle each waits for a plan a little longer each round (up to
        IDLE_POLL_MAX_S), so an idle world costs next to nothing. A rank that stops says so in the same
        flag, and every rank leaves the loop at the same round."""
        from runtime.gpu import lockstep

        pending: StepPlan | None = None
        wait = IDLE_POLL_MIN_S
        while True:
            if pending is None:
                try:
                    pending = self._plans.get_nowait()
                except queue.Empty:
                    pending = None
            agreed = lockstep.agree(self.runner, pending, self._stop_flag)
            if agreed.state >= 2:
                return
            if agreed.state == 0:
                try:
                    pending = self._plans.get(timeout=wait)
                except queue.Empty:
                    pass
                wait = min(2 * wait, IDLE_POLL_MAX_S)
                continue
            wait = IDLE_POLL_MIN_S
            plan, pending = pending, None
            try:
                lockstep.prepare(self.runner, plan, agreed)  # every rank sizes its MoE exchanges alike
                if plan is None:
                    continue
                result = self.runner.launch(plan)
            except Exception as exc:
                asyncio.run_coroutine_threadsafe(self._fail_world(plan.step if plan else -1, exc), loop)
                return
            fut = asyncio.wrap_future(self._collect.submit(result.result), loop=loop)
            loop.call_soon_threadsafe(self._outputs.put_nowait, (plan.step, fut, []))

    async def _fail_world(self, step: int, exc: Exception) -> None:
        """A failed step leaves this rank's collectives out of line with the others': report it, then end
        the process, which stops every rank (the frontend fails their requests with one error each)."""
        await self._fail(step, exc)
        log.error("rank_exiting_after_failed_step", rank=self.address)
        os.kill(os.getpid(), signal.SIGTERM)

    async def _send_outputs(self) -> None:
        while True:
            step, fut, exports = await self._outputs.get()
            try:
                out = await fut
            except Exception as exc:
                await self._fail(step, exc)
                continue
            if not self.failed and self.reports:
                engram = self.runner.engram_counters()
                if engram is not None:
                    out = msgspec.structs.replace(out, engram=engram)
                await self.send(self.scheduler, out)
                if exports:
                    self.prefill.step_done(out, exports)

    async def _fail(self, step: int, exc: Exception) -> None:
        # a failed step leaves the device state unknown: fail everything, mark the engine unhealthy
        if self.failed:
            return
        self.failed = f"{type(exc).__name__}: {exc}"
        log.error("step_failed", step=step, error=self.failed, trace=traceback.format_exc())
        await self.send(self.scheduler, WorkerFailed(step, self._client_message(exc)))

    def _client_message(self, exc: Exception) -> str:
        """What a failed request's client reads. With many ranks, a step usually fails because another
        rank died in the middle of a collective, whose own message is long and low-level: say that."""
        cfg = self.runner_config
        if cfg is None or cfg.world_size == 1:
            return self.failed
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return (
            f"rank {cfg.rank} of {cfg.world_size} failed a step (another rank may have died): "
            f"{type(exc).__name__}: {first[:160]}"
        )

"""The worker's side of disaggregation (tensors live with the worker, so the KV moves from here).

Prefill (`PrefillSide`): a `SeqStart` with a `transfer` marks its row. Right after the step that samples
the row's first token is launched, on the launch thread, the row's KV is exported (`export_request`:
device copies enqueued behind the step, so the slots may be reused afterwards). When the step's results
are back, the first token and its logprobs go with the KV to the decode address, and `KVSent` tells the
scheduler how it went.

Decode (`DecodeSide`): `KVReserve` names the row and slots of a transfer; the listener's arrivals are
imported there on the launch thread (in order with the steps), then `KVArrived` goes to the scheduler
with the first token. A reservation whose KV does not arrive in time ends with `KVArrived(error=...)`,
and an arrival without a reservation waits for one as long, then is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import structlog
import torch

from runtime.disaggregation.base import (
    FirstToken,
    KVReceiver,
    KVSender,
    Received,
    TransferError,
    make_backend,
)
from runtime.disaggregation.config import DisaggConfig
from runtime.disaggregation.protocol import KVHeader
from runtime.mailbox.messages import (
    Disagg,
    KVArrived,
    KVCancel,
    KVReserve,
    KVSent,
    Message,
    StepOutput,
    StepPlan,
)

log = structlog.get_logger(__name__)

Send = Callable[[Message], Awaitable[None]]


@dataclass
class Export:
    row: int
    target: Disagg
    kv: dict[str, torch.Tensor]


class PrefillSide:
    def __init__(self, cfg: DisaggConfig, runner, send: Send, device: torch.device) -> None:  # noqa: ANN001
        self.runner = runner
        self.send = send
        self.sender = KVSender(make_backend(cfg.backend, device), cfg.timeout)
        self.targets: dict[int, Disagg] = {}  # row -> its transfer, until its first token is sampled
        self.tasks: set[asyncio.Task] = set()

    def after_launch(self, plan: StepPlan) -> list[Export]:
        """On the launch thread, right after `plan` was launched: export the rows that sampled their
        first token (the copies queue behind the step on the device)."""
        for row in plan.released:
            self.targets.pop(row, None)
        for s in plan.added:
            if s.transfer is not None:
                self.targets[s.row] = s.transfer
        out = []
        for row, p, e, sampled in zip(
            plan.rows, plan.prefix_lens, plan.extend_lens, plan.sample, strict=True
        ):
            if sampled and row in self.targets:
                out.append(Export(row, self.targets.pop(row), self.runner.export_request(row, p + e)))
        return out

    def step_done(self, out: StepOutput, exports: list[Export]) -> None:
        """The step's tokens are on the host: send each export with its first token (in the background)."""
        for ex in exports:
            i = out.rows.index(ex.row)
            first = FirstToken(out.tokens[i])
            if out.logprobs is not None:
                first.logprob = out.logprobs[i]
                first.top_ids = list(out.top_ids[i]) if out.top_ids else []
                first.top_logprobs = list(out.top_logprobs[i]) if out.top_logprobs else []
            task = asyncio.create_task(self._send(ex, first), name=f"kv-send-{ex.target.room}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _send(self, ex: Export, first: FirstToken) -> None:
        room, peer = ex.target.room, ex.target.peer
        try:
            await self.sender.send(peer or "", room, ex.kv, first)
            error = None
        except TransferError as e:
            error = str(e)
            log.warning("kv_send_failed", room=room, peer=peer, error=error)
        await self.send(KVSent(room, error))

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        self.sender.close()


class DecodeSide:
    def __init__(
        self,
        cfg: DisaggConfig,
        runner,
        send: Send,
        launch: Executor,
        device: torch.device,  # noqa: ANN001
    ) -> None:
        self.cfg = cfg
        self.runner = runner
        self.send = send
        self.launch = launch
        self.receiver = KVReceiver(make_backend(cfg.backend, device), self._on_kv)
        self.reserved: dict[int, KVReserve] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}
        self.waiters: dict[int, asyncio.Event] = {}  # arrivals waiting for their reservation

    async def start(self) -> None:
        await self.receiver.start(self.cfg.host, self.cfg.bootstrap_port)
        log.info("kv_receiver_listening", address=self.cfg.address, backend=self.cfg.backend)

    async def stop(self) -> None:
        await self.receiver.stop()
        for t in self.timers.values():
            t.cancel()

    async def handle(self, msg: KVReserve | KVCancel) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(msg, KVCancel):
            self._forget(msg.room)
            return
        if msg.released:  # in order with the steps: before the import, as a StepPlan would have done
            await loop.run_in_executor(self.launch, self.runner.release_rows, msg.released)
        self.reserved[msg.room] = msg
        self.timers[msg.room] = loop.call_later(self.cfg.timeout, self._expire, msg.room)
        waiter = self.waiters.pop(msg.room, None)
        if waiter is not None:
            waiter.set()

    def _forget(self, room: int) -> KVReserve | None:
        timer = self.timers.pop(room, None)
        if timer is not None:
            timer.cancel()
        return self.reserved.pop(room, None)

    def _expire(self, room: int) -> None:
        if self._forget(room) is not None:
            error = f"the KV of this request did not arrive from the prefill server in {self.cfg.timeout:g}s"
            asyncio.get_running_loop().create_task(self.send(KVArrived(room=room, error=error)))

    async def _on_kv(self, header: KVHeader, received: Received) -> str | None:
        room = header.room
        if room not in self.reserved:  # the decode request may not be here yet: wait for it
            waiter = self.waiters.setdefault(room, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), self.cfg.timeout)
            except TimeoutError:
                return f"no request waits for transfer {room} on this decode server"
            finally:
                self.waiters.pop(room, None)
            if room not in self.reserved:
                return f"transfer {room} was cancelled"
        res = self._forget(room)
        assert res is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self.launch, self.runner.import_request, res.row, res.slots, received.tensors
            )
        except Exception as e:  # a KV that does not fit this pool (another model, another page layout)
            error = f"the KV could not be imported: {type(e).__name__}: {e}"
            await self.send(KVArrived(room=room, error=error))
            return error
        await self.send(
            KVArrived(
                room=room, token=header.token, logprob=header.logprob, top_ids=header.top_ids,
                top_logprobs=header.top_logprobs,
            )
        )  # fmt: skip
        return None

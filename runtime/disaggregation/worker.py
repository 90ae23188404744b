"""The worker's side of disaggregation (tensors live with the worker, so the KV moves from here).

Prefill (`PrefillSide`): a `SeqStart` with a `transfer` marks its row. Right after a step of the row is
launched, on the launch thread, what it finished is exported (`export_request`: device copies enqueued
behind the step, so the slots may be reused afterwards): each prefill chunk's positions as soon as the
chunk ran, for pools whose KV is per token without per-request state (Llama, DeepSeek-V3), so the
transfer overlaps the rest of the prefill; else the whole prompt with its state once the first token is
sampled. When the step's results are back, the chunk goes to the decode address (the last one with the
first token and its logprobs), and `KVSent` tells the scheduler how the request's transfer went.

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
    start: int = 0  # the first position it holds
    final: bool = True  # the request's last chunk (with its per-request state; the first token follows)


def streams_by_chunk(pool) -> bool:  # noqa: ANN001 (a KVPool)
    """Whether a prompt's KV can leave chunk by chunk, as its prefill chunks finish: every paged tensor
    per token (no compressed windows across a chunk's end) and no per-request state (DeepSeek-V4 has
    both: its KV leaves once the prompt is done)."""
    return all(t.rate == 1 for t in pool.slot_tensors()) and not pool.row_state(0)


class PrefillSide:
    def __init__(self, cfg: DisaggConfig, runner, send: Send, device: torch.device) -> None:  # noqa: ANN001
        self.runner = runner
        self.send = send
        self.sender = KVSender(make_backend(cfg.backend, device), cfg.timeout)
        self.stream = streams_by_chunk(runner.kv_pool)
        self.targets: dict[int, Disagg] = {}  # row -> its transfer, until its first token is sampled
        self.exported: dict[int, int] = {}  # row -> positions already sent (chunk by chunk)
        self.chains: dict[int, asyncio.Task] = {}  # room -> the send of its latest chunk
        self.failed: dict[int, str] = {}  # room -> why its chunks stopped
        self.tasks: set[asyncio.Task] = set()

    def after_launch(self, plan: StepPlan) -> list[Export]:
        """On the launch thread, right after `plan` was launched: export what the step finished of each
        transfer row (the copies queue behind the step on the device): with chunk streaming, every
        prefill chunk's positions (from the first not sent yet, so a cached prefix goes with the first
        chunk); else the whole prompt once its first token is sampled."""
        for row in plan.released:
            self.targets.pop(row, None)
            self.exported.pop(row, None)
        for s in plan.added:
            if s.transfer is not None:
                self.targets[s.row] = s.transfer
                self.exported[s.row] = 0
        out = []
        for row, p, e, sampled in zip(
            plan.rows, plan.prefix_lens, plan.extend_lens, plan.sample, strict=True
        ):
            if row not in self.targets or not (sampled or self.stream):
                continue
            start = self.exported.get(row, 0) if self.stream else 0
            kv = self.runner.export_request(row, p + e, start)
            if sampled:
                out.append(Export(row, self.targets.pop(row), kv, start))
                self.exported.pop(row, None)
            else:
                out.append(Export(row, self.targets[row], kv, start, final=False))
                self.exported[row] = p + e
        return out

    def step_done(self, out: StepOutput, exports: list[Export]) -> None:
        """The step's tokens are on the host: send each export (a final one with its first token) in the
        background; a request's chunks go one after another."""
        for ex in exports:
            first = None
            if ex.final:
                i = out.rows.index(ex.row)
                first = FirstToken(out.tokens[i])
                if out.logprobs is not None:
                    first.logprob = out.logprobs[i]
                    first.top_ids = list(out.top_ids[i]) if out.top_ids else []
                    first.top_logprobs = list(out.top_logprobs[i]) if out.top_logprobs else []
            room = ex.target.room
            task = asyncio.create_task(self._send(ex, first, self.chains.get(room)), name=f"kv-send-{room}")
            self.chains[room] = task
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _send(self, ex: Export, first: FirstToken | None, previous: asyncio.Task | None) -> None:
        room, peer = ex.target.room, ex.target.peer
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        if room not in self.failed:
            try:
                await self.sender.send(peer or "", room, ex.kv, first, start=ex.start, final=ex.final)
            except TransferError as e:
                self.failed[room] = str(e)
                self.sender.drop(room)
                log.warning("kv_send_failed", room=room, peer=peer, error=str(e))
        if ex.final:
            if self.chains.get(room) is asyncio.current_task():
                del self.chains[room]
            await self.send(KVSent(room, self.failed.pop(room, None)))

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
        res = self.reserved[room]
        if header.final:
            self._forget(room)
            slots = res.slots[header.start :]
        else:  # a chunk: the reservation waits for the rest (its deadline starts again)
            self.timers.pop(room).cancel()
            self.timers[room] = asyncio.get_running_loop().call_later(self.cfg.timeout, self._expire, room)
            n = next(t.shape[0] for k, t in received.tensors.items() if k.startswith("slot."))
            slots = res.slots[header.start : header.start + n]
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self.launch, self.runner.import_request, res.row, slots, received.tensors
            )
        except Exception as e:  # a KV that does not fit this pool (another model, another page layout)
            error = f"the KV could not be imported: {type(e).__name__}: {e}"
            self._forget(room)
            await self.send(KVArrived(room=room, error=error))
            return error
        if header.final:
            await self.send(
                KVArrived(
                    room=room, token=header.token, logprob=header.logprob, top_ids=header.top_ids,
                    top_logprobs=header.top_logprobs,
                )
            )  # fmt: skip
        return None

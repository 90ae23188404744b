"""The scheduler's side of disaggregation (host state only: no tensors here).

Prefill (`PrefillHold`): a request runs to its first token like any other (its `max_new_tokens` is 1);
its final output is then held until its worker reports the KV delivered (`KVSent`), so the prefill
server's answer says whether the transfer worked.

Decode (`DecodeReservations`): a request of a decode server first gets a row and pages for its prompt
(`reserve`: in arrival order, when the pool has room), announced to the worker (`KVReserve`). When its
KV arrives (`KVArrived`), it joins the planner as a request whose prompt is already in KV and whose first
output is the prefill's token (`BatchPlanner.admit_prefilled`); the next step feeds that token and
decoding continues. A request that ends before (client abort, transfer timeout or failure) gives its
row and pages back without caching them: its KV never arrived."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from runtime.actors.scheduler.batch_planner import BatchPlanner
from runtime.actors.scheduler.request import Req
from runtime.mailbox.messages import KVReserve, TokenLogprobs


@dataclass
class Held:
    req: Req
    tokens: list[int]
    reason: str | None
    lps: list[TokenLogprobs] | None


class PrefillHold:
    def __init__(self) -> None:
        self.held: dict[int, Held] = {}  # room -> the request's final output

    def hold(self, req: Req, tokens: list[int], reason: str | None, lps: list[TokenLogprobs] | None) -> None:
        assert req.transfer is not None
        self.held[req.transfer.room] = Held(req, tokens, reason, lps)

    def take(self, room: int) -> Held | None:
        return self.held.pop(room, None)

    def take_all(self) -> list[Held]:
        out = list(self.held.values())
        self.held.clear()
        return out


class DecodeReservations:
    def __init__(self) -> None:
        self.waiting: deque[Req] = deque()  # no row or pages yet
        self.reserved: dict[int, Req] = {}  # room -> request whose KV is awaited

    def __len__(self) -> int:
        return len(self.waiting) + len(self.reserved)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def reserve(self, planner: BatchPlanner) -> list[KVReserve]:
        """Rows and pages for the waiting requests, in order, while the pool has room."""
        out = []
        ps = planner.page_size
        while self.waiting and planner.free_rows:
            req = self.waiting[0]
            n = len(req.prompt_ids)
            pages = -(-n // ps)
            if not planner.make_room(pages):
                break
            self.waiting.popleft()
            req.row = planner.free_rows.pop()
            req.pages = planner.allocator.alloc(pages)
            req.slots = [req.pages[p // ps] * ps + p % ps for p in range(n)]
            req.cached_len = 0
            assert req.transfer is not None
            self.reserved[req.transfer.room] = req
            out.append(
                KVReserve(room=req.transfer.room, rid=req.rid, row=req.row, slots=list(req.slots),
                          released=planner.take_released())
            )  # fmt: skip
        return out

    def take(self, room: int) -> Req | None:
        return self.reserved.pop(room, None)

    def drop(self, req: Req, planner: BatchPlanner) -> bool:
        """Forget `req` (it ended before its KV arrived): its row and pages go back, uncached. True if it
        held a reservation (the worker must be told)."""
        assert req.transfer is not None
        if req in self.waiting:
            self.waiting.remove(req)
            return False
        if self.reserved.pop(req.transfer.room, None) is None:
            return False
        planner.release(req, keep=False)
        return True

    def holds(self, req: Req) -> bool:
        return req.transfer is not None and (req in self.waiting or req.transfer.room in self.reserved)

"""The DP controller: with data-parallel attention each DP rank has its own scheduler and KV pool, and this
actor (in the frontend, between the tokenizer and the schedulers) sends each request to one of them.

Routing: the rank that served the longest earlier prompt prefix this request shares (its radix cache
probably still holds it), unless that rank carries more than `IMBALANCE` requests above the least-loaded
one; otherwise the least-loaded rank. Load is a rank's running + waiting requests from its latest
`EngineStats`, plus the requests routed to it since. Aborts follow their request to its rank. Each
scheduler's stats come here and leave as one sum for the client (/metrics, /health); a cache flush goes
to every rank and succeeds when all do."""

from __future__ import annotations

from collections import OrderedDict

import msgspec
import structlog

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.mailbox.messages import (
    AbortRequest,
    CacheFlushed,
    EngineStats,
    FlushCache,
    Message,
    TokenizedRequest,
)

log = structlog.get_logger(__name__)

IMBALANCE = 4  # requests above the least-loaded rank beyond which a prefix match is ignored
PREFIX_MIN = 16  # prompt prefixes remembered: 16, 32, 64, ... tokens
REMEMBERED = 65536  # prefixes and request ids kept (least recently used dropped first)


class DpController(Actor):
    mailbox_size = 65536

    def __init__(self, dp_size: int) -> None:
        super().__init__(addresses.DP_CONTROLLER)
        self.dp_size = dp_size
        self.stats: list[EngineStats | None] = [None] * dp_size
        self.routed_since = [0] * dp_size  # requests routed to each rank since its last stats
        self.rank_of: OrderedDict[str, int] = OrderedDict()  # request id -> rank
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # hash of a prompt prefix -> rank
        self.routed = [0] * dp_size  # cumulative, for logs and tests
        self._flushes: dict[int, list[bool]] = {}

    def load(self, rank: int) -> int:
        s = self.stats[rank]
        return (s.running + s.waiting if s is not None else 0) + self.routed_since[rank]

    def choose(self, input_ids: list[int]) -> int:
        least = min(range(self.dp_size), key=lambda r: (self.load(r), self.routed[r]))
        n = PREFIX_MIN
        cached = None
        while n <= len(input_ids):
            rank = self.prefixes.get(hash(tuple(input_ids[:n])))
            if rank is None:
                break
            cached, n = rank, 2 * n
        if cached is not None and self.load(cached) <= self.load(least) + IMBALANCE:
            return cached
        return least

    def _remember(self, table: OrderedDict, key, rank: int) -> None:  # noqa: ANN001
        table[key] = rank
        table.move_to_end(key)
        if len(table) > REMEMBERED:
            table.popitem(last=False)

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, TokenizedRequest):
            rank = self.choose(msg.input_ids)
            self._remember(self.rank_of, msg.rid, rank)
            n = PREFIX_MIN
            while n <= len(msg.input_ids):
                self._remember(self.prefixes, hash(tuple(msg.input_ids[:n])), rank)
                n *= 2
            self.routed_since[rank] += 1
            self.routed[rank] += 1
            await self.send(addresses.scheduler(rank), msg)
        elif isinstance(msg, AbortRequest):
            rank = self.rank_of.get(msg.rid)
            for r in range(self.dp_size) if rank is None else (rank,):
                await self.send(addresses.scheduler(r), msg)
        elif isinstance(msg, EngineStats):
            self.stats[msg.dp_rank] = msg
            self.routed_since[msg.dp_rank] = 0
            if all(s is not None for s in self.stats):
                await self.send(addresses.CLIENT, self._total())
        elif isinstance(msg, FlushCache):
            self._flushes[msg.id] = []
            for r in range(self.dp_size):
                await self.send(addresses.scheduler(r), msg)
        elif isinstance(msg, CacheFlushed):
            answers = self._flushes.get(msg.id)
            if answers is None:
                return
            answers.append(msg.ok)
            if len(answers) == self.dp_size:
                del self._flushes[msg.id]
                await self.send(addresses.CLIENT, CacheFlushed(msg.id, all(answers)))

    def _total(self) -> EngineStats:
        """The ranks' stats as one: counts and times summed, healthy only if every rank is; the other
        fields (an error's text, speculation's and Engram's counters) the first rank's that has one."""
        stats = [s for s in self.stats if s is not None]
        fields = {}
        for name in EngineStats.__struct_fields__:
            values = [getattr(s, name) for s in stats]
            if name == "healthy":
                fields[name] = all(values)
            elif name == "dp_rank":
                fields[name] = 0
            elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                fields[name] = sum(values)
            else:
                fields[name] = next((v for v in values if v), None)
        return msgspec.structs.replace(stats[0], **fields)

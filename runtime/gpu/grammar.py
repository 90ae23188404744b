"""Token masks for constrained requests (structured output, forced tool calls), on the worker.

A constrained request's grammar matcher must advance by the token it sampled at step N before the mask
for its step N+1 can be computed, while overlap scheduling sends plan N+1 before N's tokens reach the
host. Two ways out: take a constrained request into every other step only (the scheduler holds it back
while its last step is in flight), or keep the matchers here, beside the sampler, and compute the mask
right before it is needed. This module does the second, so a constrained request decodes every step
and the scheduler knows nothing of grammars:

    launch(plan N+1):  forward N+1 is enqueued on the device (behind step N)
                       mask(rows): wait for step N's token copy of the constrained rows (their event),
                           advance each matcher by its token, fill the bitmask on the host, and copy it
                           to the device  <- the device is busy with N+1's forward meanwhile
                       sample N+1 with the mask applied to the logits, on the device
                       sampled(rows, tokens): remember where N+1's tokens will land on the host

So the mask for step N+1 is computed while the device runs step N+1's forward, the only time it can
be: after N's token exists, before N+1 samples. Only steps with a constrained row wait for the previous
step's copy; unconstrained steps launch exactly as before. On the CPU every step is synchronous anyway.

Grammars are compiled on a helper thread when the request is registered, so compiling overlaps its
prefill; the first mask waits for it. A request re-registered after a retraction replays its earlier
output tokens into a fresh matcher. A token the grammar refuses (it cannot be sampled under the mask,
but a matcher that already terminated allows anything) leaves the row unconstrained, with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
import torch

from runtime.mailbox.messages import GrammarSpec

if TYPE_CHECKING:  # xgrammar is imported with the first constrained request
    from runtime.structured.grammar import GrammarCompiler, Matcher

log = structlog.get_logger(__name__)


@dataclass
class _Pending:
    """A sampled token on its way to the host: `tokens[index]` once `ready` has passed."""

    tokens: torch.Tensor
    index: int
    ready: torch.cuda.Event | None


@dataclass
class _Row:
    matcher: Future[Matcher]
    replay: list[int]  # tokens sampled before a retraction, accepted when the matcher is first used
    pending: list[_Pending] = field(default_factory=list)
    free: bool = False  # unconstrained from now on (the grammar refused a token)


@dataclass
class TokenMask:
    """The allowed tokens of the constrained rows of one sampling batch, on the device."""

    positions: torch.Tensor  # [k] int64: the rows' positions in the batch
    bitmask: torch.Tensor  # [k, ceil(V / 32)] int32, bit t % 32 of word t // 32 set: token t allowed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with every disallowed token of the constrained rows at -inf."""
        vocab = logits.shape[-1]
        shifts = torch.arange(32, dtype=torch.int32, device=self.bitmask.device)
        bits = (self.bitmask.unsqueeze(-1) >> shifts) & 1
        allowed = bits.view(bits.shape[0], -1)[:, :vocab].bool()
        rows = logits[self.positions].masked_fill(~allowed, float("-inf"))
        return logits.index_put((self.positions,), rows)

    def at(self, first_position: torch.Tensor) -> TokenMask:
        """The same mask over a batch of several positions per row (a verify step): `first_position`
        [B] is each row's first one. A constrained row never speculates, so that is its only one."""
        return TokenMask(first_position[self.positions], self.bitmask)


class GrammarTable:
    """The matchers of the worker's constrained rows, and the mask of each sampling step."""

    def __init__(
        self, make_compiler: Callable[[], GrammarCompiler], vocab_size: int, device: torch.device
    ) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None  # built on first use (it loads the vocabulary)
        self._pool: ThreadPoolExecutor | None = None
        self.device = device
        self.words = (vocab_size + 31) // 32
        self.rows: dict[int, _Row] = {}
        pinned = device.type == "cuda"
        # Two host buffers, alternating, so a step's bitmask copy may still be in flight while the next
        # step fills the other one; an event guards each buffer's reuse.
        self._hosts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._pinned = pinned
        self._turn = 0

    def _compile(self, spec: GrammarSpec) -> Matcher:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return self._compiler.matcher(spec)

    def add(self, row: int, spec: GrammarSpec, output_ids: list[int]) -> None:
        """A constrained request enters `row`: start compiling its grammar."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.rows[row] = _Row(self._pool.submit(self._compile, spec), list(output_ids))

    def release(self, row: int) -> None:
        self.rows.pop(row, None)

    def __contains__(self, row: int) -> bool:
        return row in self.rows

    def mask(self, rows: list[int]) -> TokenMask | None:
        """The mask of a sampling batch over `rows` (None: no row is constrained). Advances each
        constrained row's matcher by the tokens it sampled since, waiting for them if need be."""
        picked = [(i, r) for i, r in enumerate(rows) if r in self.rows]
        if not picked:
            return None
        host, where = self._host(len(picked))
        for k, (i, row) in enumerate(picked):
            where[k] = i
            matcher = self._advance(row, self.rows[row])
            if matcher is None:
                host[k].fill_(-1)  # all tokens allowed
            else:
                matcher.fill(host, k)
        positions, bitmask = where[: len(picked)], host[: len(picked)]
        if self.device.type == "cpu":
            return TokenMask(positions.clone(), bitmask.clone())  # the host buffers are reused next step
        # from pinned buffers: the copies queue behind the forward without stalling this thread
        mask = TokenMask(
            positions.to(self.device, non_blocking=True), bitmask.to(self.device, non_blocking=True)
        )
        ev = torch.cuda.Event()
        ev.record()
        self._copied[self._turn] = ev
        return mask

    def sampled(self, rows: list[int], tokens: torch.Tensor) -> None:
        """`tokens` (a host tensor, its copy maybe still in flight) holds what `rows` just sampled."""
        ready = None
        for i, row in enumerate(rows):
            st = self.rows.get(row)
            if st is None:
                continue
            if ready is None and tokens.device.type == "cpu" and self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            st.pending.append(_Pending(tokens, i, ready))

    def _advance(self, row: int, st: _Row) -> Matcher | None:
        """The row's matcher after every token it sampled so far, or None when it is unconstrained."""
        try:
            matcher = st.matcher.result()
        except Exception as e:  # the frontend checked the spec, so this is unexpected: do not fail the step
            log.error("grammar_compile_failed", row=row, error=str(e))
            st.free = True
        if st.free:
            st.pending.clear()
            return None
        tokens = st.replay
        st.replay = []
        for p in st.pending:
            if p.ready is not None:
                p.ready.synchronize()
            tokens.append(int(p.tokens[p.index]))
        st.pending.clear()
        for t in tokens:
            if matcher.terminated:
                break  # tokens after the grammar's end (ignore_eos, or a step overlap wasted)
            if not matcher.accept(t):
                log.warning("grammar_refused_token", row=row, token=t)
                st.free = True
                return None
        return None if matcher.terminated else matcher

    def _host(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's host buffers (bitmask rows, batch positions) for `n` rows, once free again."""
        self._turn ^= 1
        if (ev := self._copied[self._turn]) is not None:
            ev.synchronize()
        while len(self._hosts) < 2:
            self._hosts.append(
                (torch.empty(0, self.words, dtype=torch.int32), torch.empty(0, dtype=torch.int64))
            )
        bits, where = self._hosts[self._turn]
        if bits.shape[0] < n:
            size = max(n, 2 * bits.shape[0], 8)
            bits = torch.empty(size, self.words, dtype=torch.int32, pin_memory=self._pinned)
            where = torch.empty(size, dtype=torch.int64, pin_memory=self._pinned)
            self._hosts[self._turn] = (bits, where)
        return bits, where

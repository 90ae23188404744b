"""Builds one StepPlan: decodes first, then the in-progress chunked prefill, then admissions, all under a
per-step token budget and the KV memory budget. Owns the waiting queue and the running set.

Memory: admission reserves an estimate of each running request's future KV (remaining tokens times a
decaying `new_token_ratio`, as SGLang does) so decode rarely runs dry; when it does, the cache is evicted
first, then the requests with the least progress are retracted (their KV handed to the cache, requeued at
the front). A victim may still have a step in flight: its token is kept when it comes back, and the
victim is not readmitted before that. Re-admission prefills prompt + outputs again (less what the cache
still holds) and its `SeqStart` carries the outputs, so the worker's sampler resumes the request's
penalties, min_tokens progress and seeded random draws exactly (`runtime/gpu/sampler.py`).

Cost per step is O(rows in the plan): the running set is an insertion-ordered dict (O(1) removal), the
waiting queue is only re-sorted when it changed, and sums over the running set are taken only when a
request is admitted.

Replay (`prefix_replay` > 0, DeepSeek-V4): a model whose per-request state is not in the pages rebuilds
it on a prefix hit ending at H by recomputing tokens [H - prefix_replay, H) in the request's first chunk
(`StepPlan.replay`; their slots are the cached prefix's). They count against the step's token budget.

Speculative decoding (`draft_policy`): a decoding request may verify k drafts, k + 1 positions with their
slots (`StepPlan.draft_lens`); how many it keeps is only known when the step comes back. With overlap the
next step is planned while that one runs, and the request is in it too (`StepPlan.assume_accepted`): its
slots reserve the worst case (every draft accepted), the worker moves the row back on the device by the
drafts it really rejected, and when the counts arrive the scheduler trims what neither step used
(`trim`). That needs at most one step in flight when a step is planned (overlap depth 2: the in-flight
step is the row's previous one), a worker whose drafter drafts on the device after each step
(`verify_ahead`), and a request whose sampling does not read its output count, which the worker learns
only with the counts (a seeded draw's index, min_tokens' ban on stop tokens); other requests with a
verify step in flight wait for it before they are planned again.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from runtime.actors.scheduler.kv_allocator import PageAllocator
from runtime.actors.scheduler.policy import order_waiting
from runtime.actors.scheduler.prefix_cache import PrefixCache
from runtime.actors.scheduler.request import Req
from runtime.config import INIT_NEW_TOKEN_RATIO
from runtime.mailbox.messages import SeqStart, StepPlan
from runtime.speculative.policy import DraftPolicy

CLIP_MAX_NEW_TOKENS = 4096  # cap on the reserved future tokens of one request (SGLang's constant)
RETRACT_DECODE_STEPS = 20  # after a retraction, keep room for this many decode steps of the rest


@dataclass
class PlannedStep:
    plan: StepPlan
    reqs: list[Req]  # in plan.rows order
    has_prefill: bool
    t_planned: float = 0.0


@dataclass
class BatchPlanner:
    allocator: PageAllocator
    cache: PrefixCache
    max_reqs: int
    token_budget: int
    max_model_len: int
    policy: str = "fcfs"
    init_new_token_ratio: float = INIT_NEW_TOKEN_RATIO
    prefix_replay: int = 0  # tokens before a prefix hit the worker recomputes (see the module docstring)
    draft_policy: DraftPolicy | None = None  # speculative decoding (see the module docstring)
    verify_ahead: bool = False  # the worker moves rows planned ahead of their verify step back itself
    waiting: deque[Req] = field(default_factory=deque)
    running: dict[Req, None] = field(default_factory=dict)  # an ordered set: admission order
    filling: dict[Req, None] = field(default_factory=dict)  # the running requests still prefilling
    released_rows: list[int] = field(default_factory=list)
    prefilled: list[Req] = field(default_factory=list)  # admitted with their prompt's KV already in place
    retractions: int = 0

    def __post_init__(self) -> None:
        self.free_rows = list(range(self.max_reqs, 0, -1))
        self.new_token_ratio = self.init_new_token_ratio
        self.min_new_token_ratio = self.init_new_token_ratio * 0.14
        self.ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / 600
        self._waiting_dirty = False

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    @property
    def capacity_tokens(self) -> int:
        """Token positions the whole pool holds: a request needing more can never run."""
        return self.allocator.total_pages * self.page_size

    # ------------------------------------------------------------------ memory accounting

    def _pages_for(self, req: Req, new_len: int) -> int:
        """Pages to allocate for `req` to hold `new_len` token positions."""
        ps = self.page_size
        return max(0, -(-new_len // ps) - -(-req.kv_len // ps))

    def _reserved_pages(self) -> int:
        tokens = sum(min(r.max_new_tokens - r.planned_outputs, CLIP_MAX_NEW_TOKENS) for r in self.running)
        return math.ceil(tokens * self.new_token_ratio / self.page_size)

    def _make_room(self, pages: int) -> bool:
        """Evict unlocked cache until `pages` pages are free; False if that is not enough."""
        short = pages - self.allocator.free_pages
        if short > 0:
            self.cache.evict(short)
        return pages <= self.allocator.free_pages

    def make_room(self, pages: int) -> bool:
        """Free pages (evicting cache) until `pages` are free, without dipping into the room reserved for
        the running requests' future tokens; False if there is not that much."""
        if pages + self._reserved_pages() > self.allocator.free_pages + self.cache.evictable_pages:
            return False
        return self._make_room(pages)

    def take_released(self) -> list[int]:
        """Rows released since the last plan, for a message that must release them before using one."""
        out, self.released_rows = self.released_rows, []
        return out

    def admit_prefilled(self, req: Req) -> None:
        """A request already on its row whose prompt's KV is in its slots (disaggregation's decode side)
        and whose outputs so far are `req.output_ids`: its next step feeds the last of them."""
        req.fill_len = len(req.seq_ids)
        req.planned_outputs = len(req.output_ids)
        self.running[req] = None
        self.filling[req] = None
        self.prefilled.append(req)

    def _fit(self, req: Req, n: int) -> int:
        """How many of `n` new positions the pool can hold for `req` now (after evicting cache)."""
        if n <= 0:
            return 0
        self._make_room(self._pages_for(req, req.kv_len + n))
        room = self.allocator.free_pages * self.page_size + (-req.kv_len) % self.page_size
        return min(n, room)

    def _alloc_slots(self, req: Req, n: int) -> list[int]:
        """Extend the request's KV by `n` positions, allocating pages (evicting cache if needed)."""
        need = self._pages_for(req, req.kv_len + n)
        self._make_room(need)
        req.pages.extend(self.allocator.alloc(need))
        start, ps, base = req.kv_len, self.page_size, req.cached_len
        if ps == 1:
            new = req.pages[start - base : start - base + n]
        else:  # cached prefix pages are page-aligned, so the request's own pages start at cached_len
            pages = req.pages
            new = [pages[(p - base) // ps] * ps + p % ps for p in range(start, start + n)]
        req.slots.extend(new)
        return new

    # ------------------------------------------------------------------ request lifecycle

    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self._waiting_dirty = True

    def drop_waiting(self, req: Req) -> None:
        """A waiting request ended (aborted, or its in-flight step finished it after a retraction)."""
        try:
            self.waiting.remove(req)
        except ValueError:
            pass

    def release(self, req: Req, *, keep: bool = True) -> None:
        """Take a resident request off its row and give back its KV."""
        if req.row:
            self.cache.release(req, keep=keep)
            self.released_rows.append(req.row)
            self.free_rows.append(req.row)
            req.row = 0
            req.slots = []
        self.running.pop(req, None)
        self.filling.pop(req, None)

    def _admit(self, req: Req) -> None:
        req.row = self.free_rows.pop()
        prefix, node = self.cache.match(req)
        self.cache.lock(node)
        req.cache_node = node
        req.cached_len = len(prefix)
        req.replay = min(req.cached_len, self.prefix_replay)
        req.slots = list(prefix)
        req.pages = []
        req.fill_len = len(req.seq_ids)
        req.planned_outputs = len(req.output_ids)
        if not req.retractions:
            req.reported_cached = req.cached_len
        self.running[req] = None
        self.filling[req] = None

    def _retract_for(self, decoding: list[Req]) -> list[Req]:
        """Retract the requests with the least progress until the rest can decode this step. Candidates
        are every resident request still needing KV (a chunked prefill holds pages too); the one with the
        most progress is never retracted, so the batch always moves forward. Returns the decodes that
        remain."""
        ps = self.page_size
        candidates = [r for r in self.running if r.prefilling or r.can_decode]
        victims = sorted(candidates, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)), reverse=True)
        keep = dict.fromkeys(decoding)
        need = sum(1 for r in decoding if r.kv_len % ps == 0)
        while not self._make_room(need) and len(victims) > 1:
            victim = victims.pop()
            if victim in keep:
                del keep[victim]
                need -= victim.kv_len % ps == 0
            self.release(victim, keep=True)
            victim.retractions += 1
            self.retractions += 1
            self.waiting.appendleft(victim)
            self._waiting_dirty = True
        total_new = sum(len(r.output_ids) for r in self.running) + RETRACT_DECODE_STEPS * len(self.running)
        total_max = sum(r.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(1.0, total_new / total_max)
        return list(keep)

    # ------------------------------------------------------------------ planning

    def plan(self, step: int, *, allow_prefill: bool = True) -> PlannedStep | None:
        added: list[SeqStart] = []
        rows: list[int] = []
        reqs: list[Req] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        use_last: list[bool] = []
        input_ids: list[int] = []
        out_loc: list[int] = []
        sample: list[bool] = []
        replay: list[int] = []
        budget = self.token_budget
        for r in self.prefilled:  # their prompt is in KV: the row starts with it as a cached prefix
            if r.row and not r.finished:
                ids = list(r.output_ids)
                added.append(SeqStart(r.row, r.params, r.prompt_ids, list(r.slots), sorted(r.stop_ids), ids))
        self.prefilled = []

        # 1. decodes: one token each, fed back from the device; pages for them in one allocation
        limit = self.max_model_len
        decoding = [
            r
            for r in self.running
            if r.fill_len <= len(r.slots) < limit and r.planned_outputs < r.max_new_tokens and not r.finished
        ][:budget]
        decoding = [r for r in decoding if not r.verifying or self._plans_ahead(r)]
        if decoding:
            self._plan_decodes(decoding, rows, reqs, prefix_lens, out_loc)
            self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - self.ratio_decay)
        n_dec = len(rows)
        ahead = [r.verifying > 0 for r in reqs]  # before this step's own drafts count
        budget -= n_dec
        drafts = self._plan_drafts(reqs, out_loc, budget) if self.draft_policy is not None and reqs else []
        budget -= sum(drafts)
        extend_lens.extend(1 + k for k in drafts or [0] * n_dec)
        replay.extend([0] * n_dec)
        use_last.extend([True] * n_dec)
        sample.extend([True] * n_dec)

        # 2. prefill chunks: resident requests still filling, then admissions from the queue
        has_prefill = False
        if allow_prefill and budget > 0:
            filling = list(self.filling)
            admitted = self._admit_waiting(budget - sum(r.fill_len - r.kv_len for r in filling))
            for r in admitted:  # a re-admitted request brings its outputs: its sampling state resumes
                slots, stops, outs = list(r.slots), sorted(r.stop_ids), list(r.output_ids)
                added.append(SeqStart(r.row, r.params, r.prompt_ids, slots, stops, outs, r.transfer))
            for r in filling + admitted:
                rp = r.replay  # the first chunk after a hit starts with the replay, within the budget
                room = max(budget - rp, 1) if budget > 0 else 0  # (at least one new token: may overrun)
                n = self._fit(r, min(room, r.fill_len - r.kv_len))
                if n <= 0:
                    continue
                r.replay = 0
                start = r.kv_len - rp
                prefix_lens.append(start)
                input_ids.extend(r.seq_ids[start : r.kv_len + n])
                out_loc.extend(r.slots[start:])
                out_loc.extend(self._alloc_slots(r, n))
                rows.append(r.row)
                reqs.append(r)
                extend_lens.append(rp + n)
                replay.append(rp)
                use_last.append(False)
                done = not r.prefilling
                if done:
                    del self.filling[r]
                sample.append(done)
                r.planned_outputs += int(done)
                budget -= n + rp
                has_prefill = True

        if not reqs and not self.released_rows and not added:
            return None
        for r in reqs:
            r.inflight += 1
        policy, load = self.draft_policy, n_dec
        propose = policy is None or any(
            policy.wants_drafts(r.spec, load) for r in reqs if r.params.grammar is None
        )
        plan = StepPlan(
            step,
            added,
            self.released_rows,
            rows,
            prefix_lens,
            extend_lens,
            use_last,
            input_ids,
            out_loc,
            sample,
            replay if any(replay) else [],
            drafts + [0] * (len(rows) - n_dec) if any(drafts) else [],
            ahead + [False] * (len(rows) - n_dec) if any(ahead) else [],
            propose=propose,
        )
        self.released_rows = []
        return PlannedStep(plan, reqs, has_prefill)

    def _plan_decodes(
        self,
        decoding: list[Req],
        rows: list[int],
        reqs: list[Req],
        prefix_lens: list[int],
        out_loc: list[int],
    ) -> None:
        ps = self.page_size
        fresh = decoding if ps == 1 else [r for r in decoding if len(r.slots) % ps == 0]  # need a new page
        if not self._make_room(len(fresh)):
            decoding = self._retract_for(decoding)
            fresh = decoding if ps == 1 else [r for r in decoding if len(r.slots) % ps == 0]
            if not self._make_room(len(fresh)):  # cannot happen after _retract_for; never crash on it
                keep = set(fresh[: self.allocator.free_pages])
                decoding = [r for r in decoding if r in keep or r not in fresh]
                fresh = [r for r in fresh if r in keep]
        for r, page in zip(fresh, self.allocator.alloc(len(fresh)), strict=True):
            r.pages.append(page)
        for r in decoding:
            slots = r.slots
            kv = len(slots)
            slot = r.pages[-1] if ps == 1 else r.pages[-1] * ps + kv % ps
            prefix_lens.append(kv)
            slots.append(slot)
            out_loc.append(slot)
            rows.append(r.row)
            r.planned_outputs += 1
        reqs.extend(decoding)

    def _plan_drafts(self, decoding: list[Req], out_loc: list[int], budget: int) -> list[int]:
        """Drafts each decode row verifies, with their slots: `out_loc` (one slot per row so far) gets each
        row's extra slots after its first. At most what the step's token budget, the row's remaining
        tokens and context, and the pool hold."""
        policy, load = self.draft_policy, len(decoding)
        first = out_loc[len(out_loc) - len(decoding) :]
        del out_loc[len(out_loc) - len(decoding) :]
        drafts = []
        for r, slot in zip(decoding, first, strict=True):
            limit = min(r.max_new_tokens - r.planned_outputs, self.max_model_len - r.kv_len, max(budget, 0))
            # a constrained request's mask follows its matcher token by token: it does not speculate
            k = policy.draft_len(r.spec, load, limit) if limit > 0 and r.params.grammar is None else 0
            k = self._fit(r, k)
            out_loc.append(slot)
            if k:
                out_loc.extend(self._alloc_slots(r, k))
                r.planned_outputs += k
                r.verifying += 1
                budget -= k
            drafts.append(k)
        return drafts

    def _plans_ahead(self, r: Req) -> bool:
        """Whether `r`, whose verify step is in flight, may be in the step planned now (see the module
        docstring)."""
        p = r.params
        return self.verify_ahead and (p.seed is None or p.greedy) and len(r.output_ids) >= p.min_tokens

    def trim(self, req: Req, kv_len: int) -> None:
        """A verify step came back: `req` keeps the slots of its first `kv_len` positions (what it kept,
        and what a step planned ahead of it reserved); the slots of its rejected drafts go, with the pages
        of its own that no kept position is on."""
        if not req.row or kv_len >= req.kv_len:
            return
        del req.slots[kv_len:]
        ps = self.page_size
        own = max(0, -(-(kv_len - req.cached_len) // ps))  # own pages start at the (page-aligned) prefix
        self.allocator.free(req.pages[own:])
        del req.pages[own:]

    def _admit_waiting(self, budget: int) -> list[Req]:
        """FCFS (or the configured policy) admission under the row, token and memory budgets."""
        admitted: list[Req] = []
        if not self.waiting or budget <= 0 or not self.free_rows:
            return admitted
        if self._waiting_dirty or self.policy != "fcfs":
            order_waiting(self.waiting, self.policy, self.cache)
            self._waiting_dirty = False
        ps = self.page_size
        available = self.allocator.free_pages + self.cache.evictable_pages - self._reserved_pages()
        while self.waiting and self.free_rows and budget > 0:
            req = self.waiting[0]
            if req.inflight:  # a retracted request whose last step has not come back yet
                break
            seq_len = len(req.seq_ids)
            est = seq_len + min(req.remaining_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
            need = math.ceil(est / ps) + 1
            if need > available and (self.running or admitted):
                break  # the head waits for memory; FCFS means nobody overtakes it
            if -(-(seq_len + 1) // ps) > self.allocator.free_pages + self.cache.evictable_pages:
                break  # not even the prompt fits now; wait for running requests to finish
            self.waiting.popleft()
            self._admit(req)
            admitted.append(req)
            available -= need
            budget -= req.fill_len - req.kv_len
        return admitted

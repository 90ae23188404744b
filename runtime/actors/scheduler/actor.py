"""The scheduler actor: turns queued requests into StepPlans and StepOutputs into TokenBatches.

How overlap works: the worker keeps every request's last sampled token on the device, and a decode row
in a StepPlan says "use your last token" instead of naming it. So the scheduler can plan and send step
N+1 as soon as step N is sent, without waiting for N's tokens: up to `depth` (2) steps are in flight and
the worker runs them back to back. When N's StepOutput arrives the scheduler does the host work (stop
checks, outputs, freeing) while N+1 runs, then plans N+2. A request that finished at N was already in
N+1: that one wasted token is dropped here. Two prefill steps are never overlapped, so a new prompt's
first token is not delayed behind another prefill. With `--disable-overlap` the depth is 1.
Speculating requests overlap too: a request verifying drafts at N is planned into N+1 assuming every
draft accepted, and the worker moves it back on the device by the drafts it rejected; N's counts then
trim the slots reserved for the worst case (`batch_planner.py`).

Start-up: the actor is spawned with the server's config and waits for its worker's
`WorkerCapabilities`; from them it resolves its `SchedulerConfig` (pool size, page size, whether the
radix cache applies) and builds its allocator, cache and planner. `configured` is set then.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

import structlog

from runtime import envs
from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.actors.scheduler.batch_planner import BatchPlanner, PlannedStep
from runtime.actors.scheduler.kv_allocator import PageAllocator
from runtime.actors.scheduler.output_processor import OutputProcessor
from runtime.actors.scheduler.prefix_cache import PrefixCache
from runtime.actors.scheduler.request import Req
from runtime.config import SchedulerConfig, ServerConfig
from runtime.disaggregation.scheduler import DecodeReservations, PrefillHold
from runtime.engram.addresses import hasher_for_server, plan_addresses
from runtime.engram.hashing import NgramHasher
from runtime.mailbox.messages import (
    AbortRequest,
    CacheFlushed,
    EngineStats,
    EngramCounters,
    FlushCache,
    KVArrived,
    KVCancel,
    KVSent,
    Message,
    RequestFailed,
    StepAborted,
    StepOutput,
    StepPlan,
    TokenizedRequest,
    TokenLogprobs,
    WorkerCapabilities,
    WorkerFailed,
)
from runtime.speculative.policy import DraftPolicy, SpecStats

log = structlog.get_logger(__name__)

STATS_INTERVAL_S = 0.05


class SchedulerActor(Actor):
    # Set once the worker's capabilities arrived (`_configure`): planner, allocator and cache exist.
    cfg: SchedulerConfig
    allocator: PageAllocator
    cache: PrefixCache
    planner: BatchPlanner

    def __init__(
        self,
        server: ServerConfig,
        dp_rank: int = 0,
        workers: list[str] | None = None,
        stats_to: str = addresses.CLIENT,
    ) -> None:
        super().__init__(addresses.scheduler(dp_rank))
        self.server = server
        self.dp_rank = dp_rank
        self.stats_to = stats_to  # the client, or with DP attention the DP controller that sums ranks
        self.workers = workers or [addresses.worker(dp_rank)]  # plans go to each; outputs come from the first
        self.configured = asyncio.Event()
        self.outputs = OutputProcessor()
        self.depth = 1 if server.disable_overlap else 2
        self.engram: NgramHasher | None = None
        self.engram_counters: EngramCounters | None = None
        self.inflight: deque[PlannedStep] = deque()
        self.reqs: dict[str, Req] = {}
        self.step = 0
        self.healthy = True
        self.error: str | None = None
        self.plan_s = 0.0  # planning steps
        self.wait_s = 0.0  # idle with steps in flight until a StepOutput arrived: waiting for the worker
        self.output_s = 0.0  # turning StepOutputs into TokenBatches
        self.gpu_busy_s = 0.0
        self.gpu_idle_s = 0.0
        self._gpu_last_end: float | None = None  # None between busy periods: no gap to count
        self._idle_from: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.replayed_tokens = 0
        self._last_stats = 0.0
        # prefill/decode disaggregation (runtime/disaggregation/scheduler.py)
        self.pd_prefill = PrefillHold()
        self.pd_decode = DecodeReservations()
        trace = envs.step_trace_path()
        self._trace_file = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 (lives with the actor)

    def _configure(self, caps: WorkerCapabilities) -> None:
        self.cfg = cfg = SchedulerConfig.resolve(self.server, caps)
        if not self.server.disable_radix_cache and not caps.prefix_cache:
            log.warning(
                "radix_cache_disabled", reason="the model cannot reuse a cached prefix", model=caps.model
            )
        log.info(
            "scheduler_configured",
            model=caps.model,
            kv_slots=cfg.num_kv_slots,
            page_size=cfg.page_size,
            chunked_prefill_size=cfg.chunked_prefill_size,
            radix_cache=cfg.radix_cache,
            prefix_replay=cfg.prefix_replay,
        )
        self.allocator = PageAllocator(cfg.num_kv_slots, cfg.page_size)
        self.cache = make_prefix_cache(cfg, self.allocator)
        self.planner = BatchPlanner(
            self.allocator,
            self.cache,
            max_reqs=cfg.max_running_requests,
            token_budget=cfg.chunked_prefill_size,
            max_model_len=cfg.max_model_len,
            policy=cfg.schedule_policy,
            init_new_token_ratio=cfg.init_new_token_ratio,
            prefix_replay=cfg.prefix_replay,
            draft_policy=DraftPolicy(
                cfg.max_draft, full_load_tokens=cfg.compute_bound_tokens, fixed=cfg.fixed_draft
            )
            if cfg.max_draft
            else None,
            verify_ahead=cfg.verify_ahead and self.depth > 1,
        )
        self.spec_stats = SpecStats(cfg.max_draft)
        if caps.engram:  # plans carry Engram addresses (runtime/engram/addresses.py)
            self.engram = hasher_for_server(self.server)
        self.configured.set()

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, WorkerCapabilities):
            self._configure(msg)
            await self._send_stats(force=True)  # the engine's gauges exist before the first request
            return
        if not self.configured.is_set():
            await self._refuse_before_configured(msg)
            return
        if isinstance(msg, TokenizedRequest):
            await self._on_request(msg)
        elif isinstance(msg, StepOutput):
            t0 = time.perf_counter()
            if self._idle_from is not None:
                self.wait_s += t0 - self._idle_from
            await self._on_output(msg)
            self.output_s += time.perf_counter() - t0
        elif isinstance(msg, AbortRequest):
            await self._on_abort(msg)
        elif isinstance(msg, WorkerFailed):
            await self._on_worker_failed(msg)
        elif isinstance(msg, KVArrived):
            await self._on_kv_arrived(msg)
        elif isinstance(msg, KVSent):
            await self._on_kv_sent(msg)
        elif isinstance(msg, StepAborted):
            await self._on_step_aborted(msg)
        elif isinstance(msg, FlushCache):
            ok = not self.planner.running and not self.planner.waiting and self.cache.flush()
            log.info("flush_cache", ok=ok)
            await self._send_stats(force=True)  # before the answer: /metrics right after it is current
            await self.send(self.stats_to, CacheFlushed(msg.id, ok))
        if self.pd_decode.waiting and self.healthy:
            for reserve in self.pd_decode.reserve(self.planner):
                await self.send(self.workers[0], reserve)
        await self._pump()
        self._idle_from = time.perf_counter() if self.inflight else None

    # ------------------------------------------------------------------ inputs

    async def _refuse_before_configured(self, msg: Message) -> None:
        """Nothing is admitted before the worker reported in (the engine is not ready before then)."""
        if isinstance(msg, TokenizedRequest):
            await self._fail(msg.rid, 503, "the engine is still starting", "server_error")
        elif isinstance(msg, FlushCache):
            await self.send(self.stats_to, CacheFlushed(msg.id, False))

    async def _on_request(self, msg: TokenizedRequest) -> None:
        if not self.healthy:
            await self._fail(msg.rid, 503, f"engine is unhealthy: {self.error}", "server_error")
            return
        if len(self.planner.waiting) >= self.cfg.max_queued_requests:
            await self._fail(msg.rid, 429, "too many queued requests; retry later", "rate_limit_error")
            return
        # A request must fit the pool alone (prompt + every output token), or retraction could not save it.
        capacity = self.planner.capacity_tokens
        prompt_len, max_new = len(msg.input_ids), msg.max_new_tokens
        if prompt_len + 1 > capacity:
            await self._fail(
                msg.rid,
                400,
                f"the prompt of {prompt_len} tokens can never fit the KV pool of {capacity} tokens",
                param="messages",
            )
            return
        if prompt_len + max_new > capacity:
            if msg.params.max_tokens is not None:
                await self._fail(
                    msg.rid,
                    400,
                    f"max_tokens={msg.params.max_tokens} plus the prompt's {prompt_len} "
                    f"tokens can never fit the KV pool of {capacity} tokens",
                    param="max_tokens",
                )
                return
            max_new = capacity - prompt_len  # no explicit limit: the pool is the limit, as SGLang does
        if msg.disagg is not None and msg.disagg.peer is not None:
            max_new = 1  # a prefill server computes the first token; its decode server the rest
        req = Req(
            msg.rid,
            list(msg.input_ids),
            msg.params,
            frozenset(msg.stop_ids),
            max_new,
            msg.priority,
            msg.arrival,
        )
        req.transfer = msg.disagg
        self.reqs[req.rid] = req
        if msg.disagg is not None and msg.disagg.peer is None:
            self.pd_decode.add(req)  # a decode server: the prompt's KV comes from a prefill server
        else:
            self.planner.add(req)

    async def _on_abort(self, msg: AbortRequest) -> None:
        req = self.reqs.get(msg.rid)
        if req is None or req.finished:
            return
        if self.pd_decode.holds(req):  # still waiting for its KV: nothing of it is cached
            if self.pd_decode.drop(req, self.planner):
                await self.send(self.workers[0], KVCancel(req.transfer.room))
            req.finished = "abort"
            self.reqs.pop(req.rid, None)
            self.outputs.add(req, [], req.finished)
            await self._flush_outputs()
            return
        self._finish(req, "abort" if msg.reason == "abort" else "stop")
        self.outputs.add(req, [], req.finished)
        await self._flush_outputs()

    def _account_device(self, out: StepOutput) -> None:
        """Device busy time, and device idle time between consecutive steps of a busy period (the gaps
        overlap scheduling exists to close). CUDA only: CPU steps report no device times."""
        if not out.gpu_end:
            return
        self.gpu_busy_s += out.gpu_end - out.gpu_start
        if self._gpu_last_end is not None:
            self.gpu_idle_s += max(0.0, out.gpu_start - self._gpu_last_end)
        self._gpu_last_end = out.gpu_end

    def _trace(self, plan: StepPlan, out: StepOutput) -> None:
        """One JSON line per step to $CONDUIT_STEP_TRACE: what the step held and its device times, to
        see where an end-to-end run's time goes (decode-only vs mixed steps, batch sizes)."""
        if self._trace_file is None:
            return
        decode = sum(plan.use_last)
        prefill = sum(n for n, last in zip(plan.extend_lens, plan.use_last, strict=True) if not last)
        line = {"step": plan.step, "rows": len(plan.rows), "decode": decode, "prefill_tokens": prefill,
                "gpu_start": out.gpu_start, "gpu_end": out.gpu_end}  # fmt: skip
        self._trace_file.write(json.dumps(line) + "\n")

    async def _on_output(self, out: StepOutput) -> None:
        self._account_device(out)
        self.engram_counters = out.engram or self.engram_counters
        done = self.inflight.popleft()
        self._trace(done.plan, out)
        assert done.plan.step == out.step, f"step {out.step} came back, expected {done.plan.step}"
        plan = done.plan
        drafts = plan.draft_lens or [0] * len(plan.rows)
        aheads = plan.assume_accepted or [False] * len(plan.rows)
        self.spec_stats.step(bool(plan.draft_lens), out)
        counts = out.counts or [1] * len(out.rows)
        i = j = 0  # the step's next token and next sampled row
        ended = []
        for req, did_sample, k, ahead in zip(done.reqs, plan.sample, drafts, aheads, strict=True):
            req.inflight -= 1
            n = counts[j] if did_sample else 0
            first, i, j = i, i + n, j + did_sample
            if k:
                req.verifying -= 1
                self.spec_stats.row(k, n - 1, ahead)
                # a row planned ahead may verify more drafts than the drafter then made (the rest are
                # padding, `available` is what it made for this step): the policy judges the real ones
                offered = min(k, req.spec.available)
                self.planner.draft_policy.observe(req.spec, offered, min(n - 1, offered))
                req.planned_outputs -= k + 1 - n
            if did_sample and out.draft_counts:
                self.planner.draft_policy.drafts(req.spec, out.draft_counts[j - 1], out.draft_conf[j - 1])
            elif did_sample and not plan.propose:  # the drafter only recorded this step
                req.spec.available, req.spec.confidence = 0, []
            if req.finished:  # ended while this step ran (abort, or the overlap step's wasted token)
                ended.append(req)
                continue
            if not did_sample:
                continue
            if self._take(req, out, first, n, k + 1 - n if k else None):
                ended.append(req)
        assert i == len(out.tokens), f"step {out.step}: {len(out.tokens)} tokens for {i} sampled"
        for req in ended:
            if not req.inflight:
                self.reqs.pop(req.rid, None)
        await self._flush_outputs()

    def _take(self, req: Req, out: StepOutput, first: int, n: int, rejected: int | None) -> bool:
        """Append the request's tokens out.tokens[first : first + n] up to the first that ends it, trim a
        verify step's rejected drafts (`rejected`: positions the step wrote and did not keep; None for a
        plain step), queue the outputs; True when the request finished."""
        tokens, reason, kept = out.tokens[first : first + n], None, []
        for token in tokens:
            req.output_ids.append(token)
            kept.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                break
        if rejected is not None:  # the slots reserved for them, or a step planned ahead of this one uses them
            self.planner.trim(req, req.kv_len - rejected)
        lps = None
        if out.logprobs is not None and req.params.logprobs is not None:
            lps = [self.outputs.logprob_of(out, first + t, req) for t in range(len(kept))]
        if reason is not None:
            self._finish(req, reason)
            if reason == "stop" and kept[-1] in req.stop_ids:
                kept.pop()
        if req.transfer is not None and req.transfer.peer is not None:
            self.pd_prefill.hold(req, kept, reason, lps)  # answered once the KV reached the decode server
        else:
            self.outputs.add(req, kept, reason, lps)
        return reason is not None

    async def _on_kv_sent(self, msg: KVSent) -> None:
        """Prefill side: the KV of a finished request reached its decode server, or failed to."""
        held = self.pd_prefill.take(msg.room)
        if held is None:
            return
        if msg.error is not None:
            await self._fail(held.req.rid, 502, f"KV transfer failed: {msg.error}", "server_error")
            return
        self.outputs.add(held.req, held.tokens, held.reason, held.lps)
        await self._flush_outputs()

    async def _on_kv_arrived(self, msg: KVArrived) -> None:
        """Decode side: a request's prompt KV is in its slots (or never will be: `msg.error`)."""
        req = self.pd_decode.take(msg.room)
        if req is None or req.finished:  # aborted meanwhile: its row and pages went back then
            return
        if msg.error is not None:
            self.planner.release(req, keep=False)
            req.finished = "error"
            self.reqs.pop(req.rid, None)
            await self._fail(
                req.rid, 504 if "did not arrive" in msg.error else 502, msg.error, "server_error"
            )
            return
        req.output_ids.append(msg.token)
        reason = self._stop_reason(req, msg.token)
        lps = None
        if req.params.logprobs is not None and msg.logprob is not None:
            lps = [TokenLogprobs(msg.token, msg.logprob, msg.top_ids, msg.top_logprobs)]
        kept = [msg.token]
        if reason is not None:
            self._finish(req, reason)
            if reason == "stop" and msg.token in req.stop_ids:
                kept = []
        else:
            self.planner.admit_prefilled(req)
        self.outputs.add(req, kept, reason, lps)
        await self._flush_outputs()

    async def _on_step_aborted(self, msg: StepAborted) -> None:
        """The worker could not run the step (an Engram shard crashed): its requests fail with a 503 and
        their KV from this step is dropped, not cached; the engine keeps serving."""
        done = self.inflight.popleft()
        assert done.plan.step == msg.step, f"step {msg.step} aborted, expected {done.plan.step}"
        log.error("step_aborted", step=msg.step, error=msg.error, requests=len(done.reqs))
        for req, k in zip(done.reqs, done.plan.draft_lens or [0] * len(done.reqs), strict=True):
            req.inflight -= 1
            req.verifying -= k > 0
            if not req.finished:
                req.finished = "error"
                self.planner.release(req, keep=False)
                await self._fail(req.rid, 503, f"engine step failed: {msg.error}", "server_error")
            if not req.inflight:
                self.reqs.pop(req.rid, None)

    async def _on_worker_failed(self, msg: WorkerFailed) -> None:
        log.error("worker_failed", step=msg.step, error=msg.error)
        self.healthy = False
        self.error = msg.error
        self.inflight.clear()
        for req in list(self.reqs.values()):
            if not req.finished:
                req.finished = "error"
                await self._fail(req.rid, 500, f"engine failed: {msg.error}", "server_error")
        self.reqs.clear()
        self.pd_decode = DecodeReservations()
        for held in self.pd_prefill.take_all():
            await self._fail(held.req.rid, 500, f"engine failed: {msg.error}", "server_error")
        await self._send_stats(force=True)

    # ------------------------------------------------------------------ state changes

    def _stop_reason(self, req: Req, token: int) -> str | None:
        if token in req.stop_ids and len(req.output_ids) >= req.params.min_tokens:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Req, reason: str) -> None:
        req.finished = reason
        if not req.row:
            self.planner.drop_waiting(req)
        self.planner.release(req, keep=True)
        if not req.inflight:
            self.reqs.pop(req.rid, None)

    async def _fail(
        self,
        rid: str,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        await self.send(
            addresses.CLIENT,
            RequestFailed(rid=rid, status=status, message=message, error_type=type_, param=param),
        )

    # ------------------------------------------------------------------ the step pipeline

    async def _pump(self) -> None:
        """Keep up to `depth` steps in flight."""
        while self.healthy and len(self.inflight) < self.depth:
            allow_prefill = not (self.inflight and self.inflight[-1].has_prefill)
            t0 = time.perf_counter()
            planned = self.planner.plan(self.step, allow_prefill=allow_prefill)
            self.plan_s += time.perf_counter() - t0
            if planned is None:
                break
            if self.engram is not None:
                planned.plan = plan_addresses(self.engram, planned)
            self._count_admissions(planned)
            self.step += 1
            planned.t_planned = time.perf_counter()
            self.inflight.append(planned)
            for worker in self.workers:
                await self.send(worker, planned.plan)
        if not self.inflight:
            self._gpu_last_end = None  # the engine went idle: the next gap is not the pipeline's
        await self._send_stats()

    def _count_admissions(self, planned: PlannedStep) -> None:
        rows = {s.row for s in planned.plan.added}
        for req in planned.reqs:
            if req.row in rows and req.retractions == 0:
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_tokens += req.cached_len
        for req, replayed in zip(planned.reqs, planned.plan.replay, strict=False):  # empty: no replay
            if replayed:
                self.replayed_tokens += replayed
                log.info("swa_replay", rid=req.rid, cached=req.cached_len, replayed=replayed)

    async def _flush_outputs(self) -> None:
        batch = self.outputs.take()
        if batch is not None:
            await self.send(addresses.DETOKENIZER, batch)

    async def _send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        idle = not self.inflight
        if not force and not idle and now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        stats = EngineStats(
            running=len(self.planner.running),
            waiting=len(self.planner.waiting) + len(self.pd_decode),
            kv_pages_used=self.allocator.used_pages - self.cache.evictable_pages,
            kv_pages_total=self.allocator.total_pages,
            healthy=self.healthy,
            error=self.error,
            steps=self.step,
            plan_s=self.plan_s,
            wait_s=self.wait_s,
            output_s=self.output_s,
            gpu_busy_s=self.gpu_busy_s,
            gpu_idle_s=self.gpu_idle_s,
            cached_tokens=self.cached_tokens,
            prompt_tokens=self.prompt_tokens,
            retractions=self.planner.retractions,
            evictable_tokens=self.cache.evictable_tokens,
            protected_tokens=self.cache.protected_tokens,
            swa_replay_tokens=self.replayed_tokens,
            spec=self.spec_stats.snapshot() if self.spec_stats.max_draft else None,
            engram=self.engram_counters,
            dp_rank=self.dp_rank,
        )
        await self.send(self.stats_to, stats)


def make_prefix_cache(cfg: SchedulerConfig, allocator: PageAllocator) -> PrefixCache:
    if not cfg.radix_cache:
        return PrefixCache(allocator)
    try:
        from runtime.actors.scheduler.radix_cache import RadixCache
    except ImportError:
        return PrefixCache(allocator)
    return RadixCache(allocator)

"""A model-free worker for scheduler tests and benchmarks.

`HashRunner` stands in for `ModelRunner.execute`: it keeps the same device-side state (the request table
`req_to_token`, a KV pool, each row's last sampled token) but its "model" is a hash. The token it samples
at a position is a function of the tokens *read back from the KV slots* of every earlier position, so a
scheduler bug that points a request at the wrong slots (a bad prefix-cache hit, page math, a freed page
reused too early, a retraction that loses a token) changes the outputs. `expected_tokens` computes the
same function from the true sequence, which is what a request must produce whatever the batching.

`NullRunner` returns a constant token immediately and keeps no state: the scheduler's own cost alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from runtime.actors import addresses
from runtime.actors.base import Actor
from runtime.actors.gpu_worker import GpuWorkerActor
from runtime.actors.scheduler.actor import SchedulerActor
from runtime.config import ServerConfig
from runtime.mailbox.messages import (
    EngineStats,
    Message,
    RequestFailed,
    SamplingParams,
    StepOutput,
    StepPlan,
    TokenBatch,
    TokenizedRequest,
    WorkerCapabilities,
)


def next_token(seq: list[int], vocab: int, eos: int | None = None, eos_every: int = 0) -> int:
    """The fake model: a hash of the whole sequence (tuple hashing of ints is deterministic). With
    `eos_every`, about 1 in `eos_every` positions samples `eos`."""
    h = hash(tuple(seq)) & 0xFFFF_FFFF_FFFF
    if eos is not None and eos_every and h % eos_every == 0:
        return eos
    return h % vocab


def expected_tokens(
    prompt: list[int],
    max_new: int,
    stop_ids=(),
    vocab: int = 1000,
    eos: int | None = None,
    eos_every: int = 0,
) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        tok = next_token(seq, vocab, eos, eos_every)
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


@dataclass
class Ready:
    """A fake runner's launched step: its output is already there."""

    out: StepOutput

    def result(self) -> StepOutput:
        return self.out


class FakeRunner:
    """What the fake runners share: the capabilities their worker reports (`run_scheduler` fills them in
    from the test's config, `fake_capabilities`), and launches whose outputs are ready at once."""

    prefix_replay = 0  # set > 0 to have the scheduler plan replays before prefix hits (as for V4)
    caps: WorkerCapabilities | None = None
    device = "cpu"

    def engram_counters(self) -> None:
        return None

    def save_expert_load(self) -> None:
        return None

    def capabilities(self) -> WorkerCapabilities:
        assert self.caps is not None, "set caps (fake_capabilities) before the worker starts"
        return self.caps

    def launch(self, plan: StepPlan) -> Ready:
        return Ready(self.execute(plan))

    def execute(self, plan: StepPlan) -> StepOutput:
        raise NotImplementedError


class HashRunner(FakeRunner):
    def __init__(
        self,
        num_slots: int,
        max_reqs: int,
        max_model_len: int,
        vocab: int = 1000,
        eos: int | None = None,
        eos_every: int = 0,
    ) -> None:
        self.kv: list[int | None] = [None] * num_slots  # slot -> token whose KV it holds
        self.req_to_token = [[0] * max_model_len for _ in range(max_reqs + 1)]
        self.last_token = [0] * (max_reqs + 1)
        self.vocab, self.eos, self.eos_every = vocab, eos, eos_every
        self.replays: list[tuple[int, int]] = []  # (prefix len at the hit, tokens replayed), per replay

    def execute(self, plan: StepPlan) -> StepOutput:
        for start in plan.added:
            self.req_to_token[start.row][: len(start.prefix_slots)] = start.prefix_slots
        ids = iter(plan.input_ids)
        loc = iter(plan.out_loc)
        rows, tokens = [], []
        replay = plan.replay or [0] * len(plan.rows)
        for row, prefix, ext, use_last, sample, rp in zip(
            plan.rows, plan.prefix_lens, plan.extend_lens, plan.use_last, plan.sample, replay, strict=True
        ):
            table = self.req_to_token[row]
            if rp:
                self.replays.append((prefix + rp, rp))
            for pos in range(prefix, prefix + ext):
                tok = self.last_token[row] if use_last else next(ids)
                slot = next(loc)
                assert slot != 0, "slot 0 is padding"
                if pos < prefix + rp:  # a replayed token recomputes its cached prefix slot: same token there
                    assert table[pos] == slot and self.kv[slot] == tok, f"row {row} replays a wrong slot"
                table[pos] = slot
                self.kv[slot] = tok
            if sample:
                kv = self.kv
                seq = [kv[s] for s in table[: prefix + ext]]
                assert None not in seq, f"row {row} reads an unwritten KV slot"
                tok = next_token(seq, self.vocab, self.eos, self.eos_every)
                self.last_token[row] = tok
                rows.append(row)
                tokens.append(tok)
        return StepOutput(plan.step, rows, tokens)


class NullRunner(FakeRunner):
    """Samples token 1 for every row; no KV, no table: what is left is the scheduler's own cost."""

    def execute(self, plan: StepPlan) -> StepOutput:
        rows = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        return StepOutput(plan.step, rows, [1] * len(rows))


def fake_capabilities(cfg: ServerConfig, max_model_len: int, prefix_replay: int = 0) -> WorkerCapabilities:
    """What a worker with the server's pool and page size would report."""
    return WorkerCapabilities(
        rank=0,
        model="fake",
        num_kv_slots=(cfg.kv_slot_cap() or 32768),
        page_size=cfg.page_size,
        max_reqs=cfg.resolved_max_running_requests(),
        max_model_len=max_model_len,
        prefix_cache=True,
        prefix_replay=prefix_replay,
        kv_bytes_per_token=1,
        vocab_size=1000,
    )


class Restricted:
    """A real runner behind a scheduler that uses less of it: the test config's pool size, page size and
    request rows (a subset of the runner's, so every plan stays valid for it), to put a small pool under
    pressure without building a runner per pool size."""

    def __init__(self, runner, cfg: ServerConfig) -> None:  # noqa: ANN001 - a ModelRunner
        caps = runner.capabilities()
        slots, page = (cfg.kv_slot_cap() or 32768), cfg.page_size
        assert slots <= caps.num_kv_slots and cfg.resolved_max_running_requests() <= caps.max_reqs
        assert page % caps.page_size == 0, f"page size {page} breaks the runner's {caps.page_size}"
        self.runner = runner
        self.caps = msgspec.structs.replace(
            caps, num_kv_slots=slots, page_size=page, max_reqs=cfg.resolved_max_running_requests()
        )

    def capabilities(self) -> WorkerCapabilities:
        return self.caps

    def launch(self, plan: StepPlan):  # noqa: ANN201 - the runner's pending step
        return self.runner.launch(plan)

    @property
    def device(self):  # noqa: ANN201 - the runner's device
        return self.runner.device

    def engram_counters(self):  # noqa: ANN201 - the runner's
        return self.runner.engram_counters()

    def save_expert_load(self) -> None:
        self.runner.save_expert_load()


class FakeWorker(GpuWorkerActor):
    def __init__(self, runner) -> None:  # noqa: ANN001 - HashRunner, NullRunner or another fake
        super().__init__(None, runner_factory=lambda _cfg: runner)


class _Sink(Actor):
    """Stands in for the client and the detokenizer: collects what the scheduler sends them."""

    def __init__(self, address: str, results: Results) -> None:
        super().__init__(address)
        self.results = results

    async def handle(self, msg: Message) -> None:
        self.results.on(msg)


@dataclass
class Results:
    expected: set[str]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    failed: dict[str, RequestFailed] = field(default_factory=dict)
    stats: EngineStats | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)  # every expected request ended
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # ... and the scheduler reported idle

    def on(self, msg: Message) -> None:
        if isinstance(msg, TokenBatch):
            for rid, toks, fin, cached in zip(
                msg.rids, msg.tokens, msg.finished, msg.cached_tokens, strict=True
            ):
                self.tokens.setdefault(rid, []).extend(toks)
                self.cached[rid] = cached
                if fin is not None:
                    assert rid not in self.finish, f"{rid} finished twice"
                    self.finish[rid] = fin
        elif isinstance(msg, RequestFailed):
            self.failed[msg.rid] = msg
        elif isinstance(msg, EngineStats):
            self.stats = msg
            if self.done.is_set() and msg.running == 0 and msg.waiting == 0:
                self.settled.set()
        if self.expected <= self.finish.keys() | self.failed.keys():
            self.done.set()


def tokenized(
    rid: str,
    prompt: list[int],
    max_new: int,
    *,
    stop_ids: list[int] | None = None,
    priority: int = 0,
    arrival: float = 0.0,
    max_tokens: int | None = -1,
    params: SamplingParams | None = None,
) -> TokenizedRequest:
    """A request as the tokenizer sends it; greedy unless `params` says otherwise."""
    if params is None:
        params = SamplingParams(max_tokens=max_new if max_tokens == -1 else max_tokens, temperature=0.0)
    return TokenizedRequest(
        rid=rid,
        input_ids=prompt,
        params=params,
        stop_ids=stop_ids or [],
        max_new_tokens=max_new,
        priority=priority,
        arrival=arrival,
    )


async def run_scheduler(
    cfg: ServerConfig,
    requests: list[TokenizedRequest],
    *,
    runner=None,
    max_model_len: int = 4096,
    waves: list[list[TokenizedRequest]] | None = None,
    timeout: float = 120.0,
) -> tuple[Results, SchedulerActor]:
    """Run `requests` through a real SchedulerActor and a worker over `runner` (a fake by default, or a
    real ModelRunner `Restricted` to the config's pool) in one actor system; returns when every request
    has its final message. `waves`: later batches, each sent once the previous finished."""
    from runtime.actors.system import ActorSystem

    runner = runner or HashRunner(
        (cfg.kv_slot_cap() or 32768), cfg.resolved_max_running_requests(), max_model_len
    )
    if not isinstance(runner, FakeRunner):
        runner = Restricted(runner, cfg)
    elif runner.caps is None:
        runner.caps = fake_capabilities(cfg, max_model_len, runner.prefix_replay)
    system = ActorSystem("test", {})
    results = Results({r.rid for r in requests})
    try:
        await system.spawn(_Sink(addresses.CLIENT, results))
        await system.spawn(_Sink(addresses.DETOKENIZER, results))
        sched = await system.spawn(SchedulerActor(cfg))
        await system.spawn(FakeWorker(runner))
        await sched.configured.wait()
        for batch in [requests, *(waves or [])]:
            results.expected |= {r.rid for r in batch}
            results.done.clear()
            results.settled.clear()
            for r in batch:
                await system.send(sched.address, r)
            await asyncio.wait_for(results.settled.wait(), timeout)
    finally:
        await system.stop()
    return results, sched

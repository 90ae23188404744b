"""The scheduler actor end to end against a model-free worker (`HashRunner`): its sampled token is a hash
of the tokens read back from the KV slots, so any wrong slot, lost token or reused page changes the
output. `expected_tokens` is what each request must produce, whatever the batching."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from runtime.actors.scheduler.testing import HashRunner, expected_tokens, run_scheduler, tokenized
from runtime.config import ServerConfig

EOS = 7


def run(cfg: ServerConfig, reqs, *, waves=None, eos_every: int = 0):
    runner = HashRunner(
        cfg.kv_slot_cap(), cfg.resolved_max_running_requests(), 4096, eos=EOS, eos_every=eos_every
    )
    return asyncio.run(run_scheduler(cfg, reqs, runner=runner, waves=waves, timeout=60))


def expected(req, eos_every: int = 0) -> list[int]:
    out = expected_tokens(req.input_ids, req.max_new_tokens, req.stop_ids, eos=EOS, eos_every=eos_every)
    return out[:-1] if out and out[-1] in req.stop_ids else out  # a stop token is not streamed


def mixed(seed: int, n: int, plen: int, olen: int, shared: int = 0) -> list:
    rng = random.Random(seed)
    pre = [rng.randrange(1000) for _ in range(shared)]
    reqs = []
    for i in range(n):
        own = [
            rng.randrange(1000) for _ in range(max(1, plen - shared + rng.randrange(-plen // 4, plen // 4)))
        ]
        reqs.append(
            tokenized(
                f"r{i}",
                pre[: rng.randrange(shared + 1)] + own,
                max(1, olen - rng.randrange(olen // 2)),
                stop_ids=[EOS],
            )
        )
    return reqs


def assert_all_correct(results, reqs, eos_every: int = 0) -> None:
    assert not results.failed
    wrong = [r.rid for r in reqs if results.tokens.get(r.rid, []) != expected(r, eos_every)]
    assert not wrong, f"outputs differ from the reference: {wrong}"
    s = results.stats
    assert s.running == 0 and s.waiting == 0
    assert s.kv_pages_used == 0 and s.protected_tokens == 0


def test_memory_pressure_64_requests_into_3000_slots_all_complete_exactly():
    rng = random.Random(0)
    reqs = [tokenized(f"r{i}", [rng.randrange(1000) for _ in range(300)], 200) for i in range(64)]
    results, sched = run(ServerConfig(max_total_tokens=3000, max_running_requests=64), reqs)
    assert_all_correct(results, reqs)
    assert results.stats.retractions > 0
    assert sched.allocator.used_pages == sched.cache.evictable_pages  # the rest is cache, evictable


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"disable_overlap": True},
        {"disable_radix_cache": True},
        {"page_size": 16},
        {"page_size": 16, "disable_overlap": True, "chunked_prefill_size": 64},
        {"page_size": 4, "schedule_policy": "lpm"},
    ],
)
def test_outputs_do_not_depend_on_overlap_cache_or_page_size(overrides):
    reqs = mixed(1, 20, 120, 40, shared=80)
    again = [tokenized(f"again-{r.rid}", r.input_ids, r.max_new_tokens, stop_ids=r.stop_ids) for r in reqs]
    results, _ = run(ServerConfig(max_total_tokens=8192, **overrides), reqs, waves=[again], eos_every=60)
    assert_all_correct(results, reqs + again, eos_every=60)
    if not overrides.get("disable_radix_cache"):
        assert all(results.cached[r.rid] >= len(r.input_ids) - 16 for r in again)


def test_chunked_prefill_in_progress_is_retracted_instead_of_crashing():
    # Tiny pool, small chunks: decodes run dry while a prompt is half prefilled. The old planner only
    # retracted decoding requests and raised OutOfPages here.
    rng = random.Random(15)
    reqs = [
        tokenized(
            f"r{i}", [rng.randrange(1000) for _ in range(rng.randrange(50, 290))], rng.randrange(20, 250)
        )
        for i in range(32)
    ]
    cfg = ServerConfig(
        max_total_tokens=600, chunked_prefill_size=64, max_running_requests=4, disable_radix_cache=True
    )
    results, _ = run(cfg, reqs)
    assert_all_correct(results, reqs)
    assert results.stats.retractions > 0


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_under_pressure(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    pool = rng.choice([600, 1500])
    cfg = ServerConfig(
        page_size=ps,
        max_total_tokens=pool,
        disable_overlap=rng.random() < 0.3,
        disable_radix_cache=rng.random() < 0.3,
        chunked_prefill_size=rng.choice([32, 256, 2048]),
        max_running_requests=rng.choice([4, 16, 64]),
        schedule_policy=rng.choice(["fcfs", "lpm"]),
    )
    reqs = [r for r in mixed(seed, 32, 150, 120, shared=100) if len(r.input_ids) + r.max_new_tokens < pool]
    results, _ = run(cfg, reqs, eos_every=300)
    assert_all_correct(results, reqs, eos_every=300)


def test_second_request_reuses_a_500_token_prefix():
    rng = random.Random(2)
    prefix = [rng.randrange(1000) for _ in range(500)]
    first = tokenized("first", prefix + [1, 2, 3], 8)
    second = tokenized("second", prefix + [4, 5, 6, 7], 8)
    results, _ = run(ServerConfig(), [first], waves=[[second]])
    assert_all_correct(results, [first, second])
    assert results.cached["first"] == 0
    assert results.cached["second"] >= 480


def test_a_request_that_can_never_fit_gets_400():
    cfg = ServerConfig(max_total_tokens=256)
    too_long = tokenized("long", list(range(1, 300)), 4)
    too_much = tokenized("much", list(range(1, 100)), 200)
    unbounded = tokenized("unbounded", list(range(1, 100)), 3000, max_tokens=None)  # clipped to the pool
    results, _ = run(cfg, [too_long, too_much, unbounded])
    assert results.failed["long"].status == 400 and results.failed["long"].param == "messages"
    assert results.failed["much"].status == 400 and results.failed["much"].param == "max_tokens"
    assert results.finish["unbounded"] == "length"
    assert len(results.tokens["unbounded"]) == 255 - 99


def test_queue_cap_answers_429():
    cfg = ServerConfig(max_running_requests=1, max_queued_requests=2)
    reqs = [tokenized(f"r{i}", [1, 2, 3, i + 10], 50) for i in range(5)]
    results, _ = run(cfg, reqs)
    assert len(results.failed) == 2  # one running, two waiting, two refused
    assert all(f.status == 429 for f in results.failed.values())


def test_higher_priority_is_admitted_first():
    cfg = ServerConfig(max_running_requests=1)
    reqs = [tokenized("busy", [1, 2, 3], 20)]
    reqs += [
        tokenized(f"p{p}", [5, 6, p + 10], 4, priority=p, arrival=float(i))
        for i, p in enumerate([0, 5, 1, 9])
    ]
    results, _ = run(cfg, reqs)
    order = [rid for rid in results.finish if rid != "busy"]
    assert order == ["p9", "p5", "p1", "p0"]


def test_abort_with_steps_in_flight_frees_everything():
    from runtime.mailbox.messages import AbortRequest

    long_prompt = list(range(1, 400))
    reqs = [tokenized("a", long_prompt, 50), tokenized("b", [5, 6, 7, 8], 50)]
    # chunked prefill of "a" is in flight when its abort arrives; "b" decodes when its abort arrives
    cfg = ServerConfig(chunked_prefill_size=64, max_total_tokens=1024)
    results, sched = run(cfg, [*reqs, AbortRequest("a"), AbortRequest("b")])
    assert results.finish == {"a": "abort", "b": "abort"}
    assert results.stats.kv_pages_used == 0 and results.stats.protected_tokens == 0
    assert not sched.reqs and not sched.planner.running and not sched.planner.waiting


def test_step_trace_accounts_for_every_prompt_and_decode_token(tmp_path, monkeypatch):
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("CONDUIT_STEP_TRACE", str(trace))
    reqs = [tokenized(f"r{i}", list(range(1, 101 + i)), 30) for i in range(8)]
    results, sched = run(ServerConfig(max_total_tokens=8192, chunked_prefill_size=256), reqs)
    assert_all_correct(results, reqs)
    sched._trace_file.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(len(lines)))
    assert sum(x["prefill_tokens"] for x in lines) == sum(len(r.input_ids) for r in reqs)
    assert max(x["prefill_tokens"] for x in lines) <= 256  # chunked
    # each request's first token comes from its prefill; every later one from a decode row (the overlap
    # step may decode one row past the end, whose token is dropped)
    decoded = sum(x["decode"] for x in lines)
    assert sum(len(results.tokens[r.rid]) - 1 for r in reqs) <= decoded <= sum(r.max_new_tokens for r in reqs)

"""Replay before prefix hits (what DeepSeek-V4 needs to rebuild its sliding-window and compressor state),
planned by the real scheduler against the model-free `HashRunner`: each hit's first chunk starts with
the min(H, R) tokens before the hit, on the cached prefix's own slots (the runner checks the slot holds
that token), every output stays exact under retraction and chunking, and the replayed tokens are
counted in the engine stats."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime.actors.scheduler.testing import HashRunner, expected_tokens, run_scheduler, tokenized
from runtime.config import ServerConfig

EOS = 7


def run(cfg: ServerConfig, reqs, replay: int, waves=None):
    runner = HashRunner(cfg.kv_slot_cap(), cfg.resolved_max_running_requests(), 4096, eos=EOS, eos_every=200)
    runner.prefix_replay = replay
    results, _ = asyncio.run(run_scheduler(cfg, reqs, runner=runner, waves=waves, timeout=60))
    return results, runner


def assert_exact(results, reqs) -> None:
    assert not results.failed
    for r in reqs:
        out = expected_tokens(r.input_ids, r.max_new_tokens, r.stop_ids, eos=EOS, eos_every=200)
        assert results.tokens[r.rid] == (out[:-1] if out and out[-1] in r.stop_ids else out), r.rid
    assert results.stats.kv_pages_used == 0 and results.stats.protected_tokens == 0


@pytest.mark.parametrize("replay", [8, 40, 10**6])  # the window, a longer bound, everything (exact mode)
def test_hits_replay_the_tokens_before_the_prefix_under_retraction(replay):
    rng = random.Random(8)
    shared = [rng.randrange(1000) for _ in range(90)]
    reqs = [
        tokenized(f"r{i}", shared[: rng.randrange(40, 91)] + [rng.randrange(1000) for _ in range(30)], 150,
                  stop_ids=[EOS])
        for i in range(32)
    ]  # fmt: skip
    cfg = ServerConfig(page_size=8, max_total_tokens=600, max_running_requests=16, chunked_prefill_size=96)
    results, runner = run(cfg, reqs, replay)
    assert_exact(results, reqs)
    assert results.stats.retractions > 0 and len(runner.replays) > 20
    assert all(h % 8 == 0 and rp == min(h, replay) for h, rp in runner.replays)
    assert results.stats.swa_replay_tokens == sum(rp for _, rp in runner.replays)


def test_a_replay_longer_than_the_step_budget_still_makes_progress():
    prefix = list(range(100, 164))
    first, second = tokenized("a", prefix + [1, 2, 3], 6), tokenized("b", prefix + [4, 5], 6)
    cfg = ServerConfig(page_size=8, chunked_prefill_size=16)
    results, runner = run(cfg, [first], replay=40, waves=[[second]])
    assert_exact(results, [first, second])
    assert results.cached["b"] == 64 and runner.replays == [(64, 40)]

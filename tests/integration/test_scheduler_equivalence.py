"""Greedy outputs do not depend on how the scheduler batches: overlap on/off, radix cache on/off, page
sizes 1 and 16, on a mixed batch of 20 requests (varied prompt lengths and max_tokens, some sharing a
prefix). The real SmolLM2 weights run in one ModelRunner shared by every configuration, so only the
scheduler changes between runs."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime.actors.scheduler.testing import run_scheduler, tokenized
from runtime.config import ServerConfig

MAX_MODEL_LEN = 512
SLOTS = 4096

CONFIGS = {
    "overlap-radix-page1": {},
    "no-overlap": {"disable_overlap": True},
    "no-radix": {"disable_radix_cache": True},
    "page16-chunked": {"page_size": 16, "chunked_prefill_size": 64},
}


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from runtime.config import RunnerConfig
    from runtime.gpu.model_runner import ModelRunner

    return ModelRunner(
        RunnerConfig(
            model_path=str(smollm2_path), num_kv_slots=SLOTS, max_reqs=16, max_model_len=MAX_MODEL_LEN
        )
    )


def mixed_batch() -> list:
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    reqs = []
    for i in range(20):
        own = [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))]
        prompt = shared[: rng.choice([0, 17, 40])] + own
        reqs.append(tokenized(f"r{i}", prompt, rng.randrange(2, 7)))
    return reqs


def run(runner, reqs, **overrides):
    # 10 rows for 20 requests: the later half is admitted as the first finishes, and hits the cache
    cfg = ServerConfig(max_total_tokens=SLOTS, max_running_requests=10, **overrides)
    results, _ = asyncio.run(run_scheduler(cfg, reqs, runner=runner, max_model_len=MAX_MODEL_LEN))
    assert not results.failed
    return results


def test_greedy_outputs_identical_across_overlap_radix_and_page_size(runner):
    reqs = mixed_batch()
    results = {name: run(runner, reqs, **cfg) for name, cfg in CONFIGS.items()}
    base = results["overlap-radix-page1"].tokens
    assert all(len(base[r.rid]) == r.max_new_tokens for r in reqs)
    assert sum(results["overlap-radix-page1"].cached.values()) > 0  # the cache was really used
    for name, res in results.items():
        diff = [r.rid for r in reqs if res.tokens[r.rid] != base[r.rid]]
        assert not diff, f"{name}: {diff} differ from overlap-radix-page1"

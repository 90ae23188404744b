"""A retracted request resumes its sampling state exactly: seeded sampled requests with penalties and
min_tokens give the same tokens when a small KV pool forces retractions as with ample memory (page sizes 1
and 16; prefill chunks of 32 tokens, so a re-admission's prefill may span steps that do not sample).
The real scheduler, worker actor, ModelRunner and sampler run a tiny random Llama: fast on CPU, and its
flat-ish logits make sampling genuinely random, so a restarted random stream or a forgotten penalty
count changes the output."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime.actors.scheduler.testing import run_scheduler, tokenized
from runtime.config import ServerConfig
from runtime.mailbox.messages import SamplingParams

MAX_MODEL_LEN = 128
EOS = 2
MAX_NEW = 40
# 6 requests of 20 + 40 tokens: admission reserves 0.7 of each one's outputs, so all get in (page 1:
# 6 x 49 <= 300), then they need 6 x 60. Each pool retracts one request (r5, r3) after 25-28 outputs,
# below min_tokens, with a step of it in flight.
TIGHT = {"page1": {"max_total_tokens": 300}, "page16": {"max_total_tokens": 256, "page_size": 16}}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from runtime.config import RunnerConfig
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, seed=5)
    return ModelRunner(RunnerConfig(str(path), num_kv_slots=4096, max_reqs=8, max_model_len=MAX_MODEL_LEN))


def seeded_batch() -> list:
    rng = random.Random(4)
    reqs = []
    for i in range(6):
        params = SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0.9,
            top_p=0.95,
            seed=1000 + i,
            repetition_penalty=1.3,
            frequency_penalty=1.0 * (i % 2),  # strong: the tiny model's logits are near 0
            presence_penalty=1.0 * (i % 3 != 0),
            min_tokens=32,  # EOS stays banned across the retraction, so the pressure stays too
        )
        prompt = [rng.randrange(3, 128) for _ in range(20)]
        reqs.append(tokenized(f"r{i}", prompt, MAX_NEW, stop_ids=[EOS], params=params))
    return reqs


def run(runner, reqs, **cfg):
    cfg = {"max_total_tokens": 4096, "max_running_requests": 8, "chunked_prefill_size": 32, **cfg}
    results, _ = asyncio.run(
        run_scheduler(ServerConfig(**cfg), reqs, runner=runner, max_model_len=MAX_MODEL_LEN)
    )
    assert not results.failed
    return results


def test_seeded_sampled_outputs_are_the_same_with_and_without_retractions(runner):
    reqs = seeded_batch()
    ample = run(runner, reqs)
    assert ample.stats.retractions == 0
    assert all(len(ample.tokens[r.rid]) >= 32 for r in reqs)
    for name, cfg in TIGHT.items():
        tight = run(runner, reqs, **cfg)
        assert tight.stats.retractions > 0, name
        diff = [r.rid for r in reqs if tight.tokens[r.rid] != ample.tokens[r.rid]]
        assert not diff, f"{name}: {diff} changed under retraction"

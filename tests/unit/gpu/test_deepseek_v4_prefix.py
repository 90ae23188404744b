"""DeepSeek-V4 prefix-cache hits through the paged pools, against a cold run of the same prompt (float32,
the tiny configs of the parity tests). Request A caches a prefix of H tokens; request B = that prefix +
its own tokens runs cold in one row and as a hit in another (a reused row: stale state from earlier
requests is in it), replaying the tokens [H - R, H) before the hit and then prefilling in two chunks
and decoding greedily. With R = H (exact mode) the hit equals the cold run. With R = the window
(bounded, the default) it is not bit-identical by design: window attention of the replayed tokens reads
nothing below H - R; once R covers the window's receptive field through every layer,
num_layers * (window - 1), it is exact again, because all that reaches later positions from below
H - R is the cached compressed entries. A hit never writes the cached prefix's entries."""

from __future__ import annotations

import asyncio

import pytest
import torch

from runtime.actors.scheduler.testing import run_scheduler, tokenized
from runtime.config import RunnerConfig, ServerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_hit_vs_cold

CONFIGS = V4_TINY_CONFIGS
PAGE, SLOTS, H = 8, 1024, 48
EXACT_TOL = 1e-5


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_deepseek_v4(path, seed=5, **CONFIGS[request.param])


@pytest.fixture(scope="module")
def runner(model):
    cfg = RunnerConfig(str(model[0]), num_kv_slots=SLOTS, max_reqs=4, max_model_len=128, cpu_threads=1)
    return ModelRunner(cfg)


def test_exact_replay_hit_equals_a_cold_run(runner):
    r = v4_hit_vs_cold(runner, H, replay=H, seed=1)
    torch.testing.assert_close(r.hit, r.cold, atol=EXACT_TOL, rtol=0)
    assert r.hit_tokens == r.cold_tokens and r.cache_untouched


def test_bounded_replay_reads_nothing_below_h_minus_r(runner):
    cfg = runner.config
    window, field = cfg.sliding_window, cfg.num_hidden_layers * (cfg.sliding_window - 1)
    assert runner.prefix_replay == window  # the default bound
    r = v4_hit_vs_cold(runner, H, replay=window, seed=3)
    assert r.max_diff > 1e-3 and r.cache_untouched  # not exact by design (figures: docs/deepseek_v4.md)
    r = v4_hit_vs_cold(runner, H, replay=field, seed=3)
    torch.testing.assert_close(r.hit, r.cold, atol=EXACT_TOL, rtol=0)  # the receptive field: exact again
    assert r.hit_tokens == r.cold_tokens and r.cache_untouched


def greedy_reference(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation by use_cache=False full forwards (the parity tests' oracle)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_scheduled_hits_retraction_and_row_reuse_match_transformers(model):
    """The real scheduler over a pool too small for the load (a request is retracted and re-admitted),
    with exact replay: requests sharing a 16-token prefix hit it once the first ones finish, rows are
    reused, and every greedy continuation equals transformers'."""
    path, ref = model
    exact = dict(swa_replay_exact=True, cpu_threads=1)
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=96, max_reqs=3, max_model_len=128, **exact))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 128, (3 + i,), generator=g).tolist() for i in range(4)]
    reqs = [tokenized(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    cfg = ServerConfig(page_size=PAGE, max_total_tokens=96, max_running_requests=3, chunked_prefill_size=64)
    results, _ = asyncio.run(run_scheduler(cfg, reqs, runner=runner, max_model_len=128, timeout=300))
    assert not results.failed and results.stats.retractions > 0
    assert results.stats.swa_replay_tokens >= 2 * 16 and max(results.cached.values()) >= 16
    for r, p in zip(reqs, prompts, strict=True):
        assert results.tokens[r.rid] == greedy_reference(ref, p, 24), r.rid

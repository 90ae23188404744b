"""Speculation on a tiny random DeepSeek-V4 (sliding, CSA and HCA layers; window 8, compressor rates 4
and 8): the verify step rolls back what its rejected positions wrote into each row's sliding-window ring
and compressor / indexer tails, so greedy and seeded outputs equal plain decoding's with the n-gram and
the MTP (V4's MTP block, its chain's ring entries restored too) and the DSpark drafters, with overlap on and off, the radix cache on and off (prefix hits replay), paged,
and under retraction. Without the rollback the same runs differ (checked here too)."""

from __future__ import annotations

import pytest

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4.kv_pool import V4KVPool
from runtime.gpu.testing import save_tiny_deepseek_v4
from tests.unit.speculative.test_lossless import MAX_MODEL_LEN, SLOTS, batch, run

CONFIGS = {  # V4's pages are multiples of its compressor rates
    "overlap-radix": {"page_size": 8},
    "no-overlap": {"disable_overlap": True, "page_size": 8},
    "no-radix": {"disable_radix_cache": True, "page_size": 8},
    "page16": {"page_size": 16, "chunked_prefill_size": 64},
}


def make_runner(path, **spec) -> ModelRunner:  # noqa: ANN001
    # exact replay: a prefix hit (and a retracted request's return) rebuilds the ring and tails from
    # position 0, so its outputs equal a cold run's and plain and speculative runs compare token for token
    cfg = RunnerConfig(str(path), num_kv_slots=SLOTS, max_reqs=8, max_model_len=MAX_MODEL_LEN, cpu_threads=1,
                       swa_replay_exact=True, **spec)  # fmt: skip
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    save_tiny_deepseek_v4(path, mtp_layers=1)  # (the main model is the same without its MTP block)
    return path


@pytest.fixture(scope="module")
def plain(v4):
    return make_runner(v4)


def spec_runner(v4, drafter: str) -> ModelRunner:  # noqa: ANN001
    return make_runner(v4, speculative_algorithm=drafter, speculative_num_draft_tokens=3)


def draft_policy(drafter: str) -> dict:
    """Randomly initialised drafters (MTP, DSpark) give confidences the adaptive policy seldom verifies:
    their runs verify every draft (`--speculative-draft-policy fixed`); the n-gram drafter's keep the
    default policy."""
    return {} if drafter == "ngram" else {"speculative_draft_policy": "fixed"}


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "dspark"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_v4_speculation_equals_plain_decoding_in_every_configuration(v4, plain, drafter, sampled):
    spec = spec_runner(v4, drafter)
    reqs = batch(sampled)
    want = run(plain, reqs, page_size=8).tokens
    for name, cfg in CONFIGS.items():
        got = run(spec, reqs, **cfg, **draft_policy(drafter))
        bad = [r.rid for r in reqs if got.tokens[r.rid] != want[r.rid]]
        assert not bad, f"{name}: {bad} differ from plain decoding"
        s = got.stats.spec
        assert s.drafted > 0, name
        if drafter == "ngram" and not sampled:
            assert s.accepted > 0, name  # blocks partly accepted: the rollback keeps a prefix


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "dspark"])
def test_v4_speculation_survives_retraction(v4, plain, drafter):
    spec = spec_runner(v4, drafter)
    reqs = batch(False, n=8, max_new=120, stem_len=0, eos=False)
    want = run(plain, reqs, page_size=8).tokens
    got = run(spec, reqs, max_total_tokens=320, chunked_prefill_size=64, page_size=8, **draft_policy(drafter))
    assert got.stats.retractions > 0 and got.stats.spec.drafted > 0
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}


def test_without_the_rollback_v4_speculation_differs(v4, plain, monkeypatch):
    """The control: rejected drafts left in the rings and tails change the outputs."""
    monkeypatch.setattr(V4KVPool, "restore_rejected", lambda self, saved, kept: None)
    spec = spec_runner(v4, "ngram")
    reqs = batch(False)
    want = run(plain, reqs, page_size=8).tokens
    got = run(spec, reqs, page_size=8)
    assert any(got.tokens[r.rid] != want[r.rid] for r in reqs)


def test_v4_refuses_blocks_longer_than_its_ring_and_tails(v4):
    with pytest.raises(ValueError, match="rolls back blocks of at most 8 tokens"):
        make_runner(v4, speculative_algorithm="ngram", speculative_num_draft_tokens=8)

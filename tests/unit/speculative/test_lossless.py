"""Lossless speculation through the real scheduler and the real model runner: every request's tokens
equal the non-speculative run's, token for token, greedy and seeded-sampled (penalties, min_tokens, stop
ids), with overlap on and off, the radix cache on and off, and under retraction in a pool too small for
the load; and the drafts were really used (accepted ones among them). With overlap on, greedy rows of a
drafter that drafts on the device are planned into the step after a verify step before its counts are
known (`StepPlan.assume_accepted`): the runs check that happened. Tiny random Llama and DeepSeek-V3
checkpoints, float32 on the CPU (their greedy text loops, which the n-gram drafter finds)."""

from __future__ import annotations

import asyncio
import random

import pytest

from runtime.actors.scheduler.testing import run_scheduler, tokenized
from runtime.config import RunnerConfig, ServerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import save_tiny_deepseek_v3, save_tiny_llama
from runtime.mailbox.messages import SamplingParams

MAX_MODEL_LEN, SLOTS, EOS = 256, 4096, 2
CONFIGS = {
    "overlap-radix": {},
    "no-overlap": {"disable_overlap": True},
    "no-radix": {"disable_radix_cache": True},
    "page16": {"page_size": 16, "chunked_prefill_size": 64},
}
FAMILIES = {"llama": save_tiny_llama, "deepseek_v3": save_tiny_deepseek_v3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runners(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)

    def runner(**spec) -> ModelRunner:
        cfg = RunnerConfig(str(path), num_kv_slots=SLOTS, max_reqs=8, max_model_len=MAX_MODEL_LEN, cpu_threads=1,
                           **spec)  # fmt: skip
        return ModelRunner(cfg)

    return runner(), runner(speculative_algorithm="ngram", speculative_num_draft_tokens=3)


def batch(sampled: bool, n: int = 10, max_new: int = 40, stem_len: int = 12, eos: bool = True) -> list:
    rng = random.Random(5)
    stem = [rng.randrange(3, 128) for _ in range(stem_len)]
    reqs = []
    for i in range(n):
        motif = [rng.randrange(3, 128) for _ in range(rng.randrange(2, 5))]
        prompt = (stem if i % 3 == 0 else []) + motif * rng.randrange(2, 5)
        params = SamplingParams(
            max_tokens=max_new, temperature=0.8, seed=100 + i, repetition_penalty=1.1,
            frequency_penalty=0.2 * (i % 2), min_tokens=8,
        ) if sampled else None  # fmt: skip
        reqs.append(tokenized(f"r{i}", prompt, max_new, stop_ids=[EOS] if eos else [], params=params))
    return reqs


def run(runner: ModelRunner, reqs: list, **overrides):
    cfg = {"max_total_tokens": SLOTS, "max_running_requests": 8, **overrides}
    results, _ = asyncio.run(
        run_scheduler(ServerConfig(**cfg), reqs, runner=runner, max_model_len=MAX_MODEL_LEN)
    )
    assert not results.failed
    return results


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def planned_ahead(spec: ModelRunner, sampled: bool, cfg: dict) -> bool:
    """Whether a run's verify rows are planned ahead of their previous verify step's counts: with
    overlap, a drafter that drafts on the device, and requests whose draws do not read their output
    count (the seeded batch's are seeded)."""
    return spec.verify_ahead and not sampled and not cfg.get("disable_overlap")


def assert_lossless_in_every_configuration(plain: ModelRunner, spec: ModelRunner, sampled: bool) -> None:
    """The speculating runner's tokens equal the plain runner's in every scheduler configuration, drafts
    were verified in each, and never planned ahead where they cannot be (the drafters' own tests call
    this; their random weights give confidences the adaptive policy seldom verifies, so every draft is
    verified here: `--speculative-draft-policy fixed`)."""
    reqs = batch(sampled)
    want = run(plain, reqs).tokens
    for name, cfg in CONFIGS.items():
        got = run(spec, reqs, speculative_draft_policy="fixed", **cfg)
        diff = {r.rid: first_difference(got.tokens[r.rid], want[r.rid]) for r in reqs}
        assert not {rid: i for rid, i in diff.items() if i is not None}, name
        assert got.stats.spec.drafted > 0, name
        assert planned_ahead(spec, sampled, cfg) or not got.stats.spec.ahead_rows, name


def assert_lossless_under_retraction(plain: ModelRunner, spec: ModelRunner) -> None:
    """Long greedy outputs in a pool too small for them: requests are retracted, drafts were verified
    (every draft held: the fixed policy), and the tokens still equal plain decoding's."""
    reqs = batch(False, n=8, max_new=120, stem_len=0, eos=False)
    want = run(plain, reqs).tokens
    got = run(spec, reqs, max_total_tokens=300, chunked_prefill_size=64, speculative_draft_policy="fixed")
    assert got.stats.retractions > 0 and got.stats.spec.drafted > 0
    assert spec.verify_ahead or not got.stats.spec.ahead_rows
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculative_outputs_equal_plain_decoding_in_every_configuration(runners, sampled):
    plain, spec = runners
    reqs = batch(sampled)
    want = run(plain, reqs).tokens
    for name, cfg in CONFIGS.items():
        got = run(spec, reqs, **cfg)
        diff = {r.rid: first_difference(got.tokens[r.rid], want[r.rid]) for r in reqs}
        diff = {rid: i for rid, i in diff.items() if i is not None}
        assert not diff, f"{name}: {diff} (first differing token) differ from plain decoding"
        s = got.stats.spec
        # drafts were verified; greedy loops accept some (sampled ones on a near-uniform random model
        # rarely do: tests/unit/speculative/test_distribution.py covers the accept path of sampling)
        assert s.drafted > 0 and (sampled or s.accepted > 0), f"{name}: {s}"
        assert (s.ahead_rows > 0) == planned_ahead(spec, sampled, cfg), f"{name}: {s}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculative_outputs_survive_retraction(runners, sampled):
    """Long outputs from short prompts outgrow what admission reserved for them (a 0.7 share of each
    request's remaining tokens): the pool runs dry while they decode and requests are retracted, some
    with a verify step in flight, then re-admitted. Every draft held is verified (the fixed policy), so
    the drafts' slots press on the pool whatever the adaptive policy would make of the load."""
    plain, spec = runners
    reqs = batch(sampled, n=8, max_new=120, stem_len=0, eos=False)
    want = run(plain, reqs).tokens
    got = run(spec, reqs, max_total_tokens=300, chunked_prefill_size=64, speculative_draft_policy="fixed")
    assert got.stats.retractions > 0
    assert (got.stats.spec.ahead_rows > 0) == planned_ahead(spec, sampled, {})
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}


def test_a_draft_model_is_lossless_and_the_target_as_its_own_draft_is_always_accepted(tmp_path):
    """The draft-model drafter: with another tiny Llama as the draft, greedy and seeded outputs equal
    plain decoding's; with the target as its own draft, every draft is accepted at temperature 0."""
    save_tiny_llama(tmp_path / "target")
    save_tiny_llama(tmp_path / "draft", seed=1)

    def runner(**spec) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(tmp_path / "target"), num_kv_slots=SLOTS, max_reqs=8,
                                        max_model_len=MAX_MODEL_LEN, cpu_threads=1, **spec))  # fmt: skip

    plain = runner()
    spec = {"speculative_algorithm": "draft-model", "speculative_num_draft_tokens": 3}
    other = runner(**spec, speculative_draft_model_path=str(tmp_path / "draft"))
    itself = runner(**spec, speculative_draft_model_path=str(tmp_path / "target"))
    for sampled in (False, True):
        reqs = batch(sampled)
        want = run(plain, reqs).tokens
        for r in (other, itself):
            got = run(r, reqs, page_size=16)
            assert {q.rid: got.tokens[q.rid] for q in reqs} == {q.rid: want[q.rid] for q in reqs}
            assert got.stats.spec.drafted > 0
    s = run(itself, batch(False)).stats.spec
    assert s.accepted == s.drafted > 0
    # with overlap, rows were planned ahead of their verify steps' counts (the draft model drafts on the
    # device right after each step, from the device's lengths)
    assert s.ahead_rows > 0


def test_requests_whose_drafts_fail_stop_drafting(runners, monkeypatch):
    """Seeded sampling on a near-uniform random model rejects almost every draft, and a request whose
    estimate falls below the step's threshold (or into a cooldown) verifies no more drafts: steps after
    which no row may verify drafts only record their tokens (no lookup: what speculation costs where
    it does not pay), and the outputs still equal plain decoding's."""
    plain, spec = runners
    drafter = spec.spec.drafter
    calls = {"record": 0, "observe": 0}
    record, observe = drafter.record, drafter.observe

    def counting(name, method):
        def call(step):
            calls[name] += 1
            return method(step)

        return call

    monkeypatch.setattr(drafter, "record", counting("record", record))
    monkeypatch.setattr(drafter, "observe", counting("observe", observe))
    reqs = batch(True, n=3, max_new=120, stem_len=0, eos=False)
    want = run(plain, reqs).tokens
    got = run(spec, reqs)
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}
    s = got.stats.spec
    assert s.drafted > s.accepted and calls["record"] > calls["observe"] > 0, (calls, s)

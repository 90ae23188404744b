"""The drafters through `conduit serve` (MTP and DSpark, randomly initialised, and n-gram on a tiny random
DeepSeek-V3 with an MTP layer; the same three on a tiny random DeepSeek-V4 with an MTP block, whose
verify steps roll back their rings and tails; both with SmolLM2's tokenizer; DSpark on SmolLM2 itself): greedy answers
equal the plain server's token for token, with overlap on and off, the radix cache on and off, and in a
pool small enough to retract requests; /metrics counts the drafts.

On the tiny models the small pool is the overlap-and-radix case: overlap and the cache are on there, and
retracted requests come back through the cache."""

from __future__ import annotations

import pytest

from runtime.gpu.testing import copy_tokenizer, save_tiny_deepseek_v3, save_tiny_deepseek_v4
from tests.integration.test_speculative_serving import MAX_TOKENS, answers, plain  # noqa: F401 - a fixture

# the small pool: admission reserves 7% of each answer (--schedule-conservativeness 0.1), so all six
# prompts start and their answers outgrow the 400 slots (as in test_speculative_serving.py)
FLAGS = {
    "no-overlap-no-radix": ("--disable-overlap", "--disable-radix-cache"),
    "small-pool": ("--max-total-tokens", "400", "--schedule-conservativeness", "0.1"),
}


@pytest.fixture(scope="module")
def v3_dir(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v3-mtp")
    save_tiny_deepseek_v3(path, seed=11, vocab_size=49152, max_position_embeddings=1024, mtp_layers=1)
    copy_tokenizer(smollm2_path, path)
    return path


def spec_flags(drafter: str) -> tuple[str, ...]:
    """Randomly initialised drafters (MTP, DSpark) give confidences the adaptive policy seldom verifies:
    their servers verify every draft; the n-gram drafter's keep the default policy."""
    fixed = () if drafter == "ngram" else ("--speculative-draft-policy", "fixed")
    return ("--speculative-algorithm", drafter, "--speculative-num-draft-tokens", "3", *fixed)


def serve(server_runner, tmp_path, model, *flags):  # noqa: ANN001, ANN201
    return server_runner(tmp_path, "--model", str(model), "--max-model-len", "1024", *flags)


@pytest.fixture(scope="module")
def v3_plain(v3_dir, server_runner, tmp_path_factory):
    with serve(server_runner, tmp_path_factory.mktemp("plain"), v3_dir) as s:
        return answers(s.base_url)


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
@pytest.mark.parametrize("drafter", ["mtp", "dspark", "ngram"])
def test_deepseek_v3_greedy_answers_equal_the_plain_servers(
    v3_dir, v3_plain, server_runner, tmp_path, drafter, flags
):
    small = "--max-total-tokens" in flags
    spec = spec_flags(drafter)
    with serve(server_runner, tmp_path, v3_dir, *spec, *flags) as s:
        got = answers(s.base_url, 2 * MAX_TOKENS if small else MAX_TOKENS)
        m = s.wait_idle()
    for i, (want, have) in enumerate(zip(v3_plain, got, strict=True)):
        assert have[:MAX_TOKENS] == want, f"prompt {i}: {have!r} != {want!r}"
    assert m["conduit_spec_draft_tokens_total"] > 0 and m["conduit_spec_verify_steps_total"] > 0
    if small:
        assert m["conduit_engine_retractions_total"] > 0


# Retraction under DSpark is covered on the tiny models here and in tests/unit/speculative/test_dspark.py:
# on SmolLM2 DSpark's pass through the head (49,152 x 576 per draft position, every step) costs about a
# decode step on the CPU, and 6 long answers in a small pool outlast the client's timeout on a shared CPU.
SMOLLM2_FLAGS = {"overlap-radix": (), "no-overlap-no-radix": FLAGS["no-overlap-no-radix"]}


@pytest.mark.parametrize("flags", list(SMOLLM2_FLAGS.values()), ids=list(SMOLLM2_FLAGS))
def test_smollm2_dspark_greedy_answers_equal_the_plain_servers(plain, server_runner, tmp_path, flags):  # noqa: F811
    spec = spec_flags("dspark")
    with server_runner(tmp_path, *spec, *flags) as s:
        got = answers(s.base_url)
        m = s.wait_idle()
    assert got == plain
    assert m["conduit_spec_draft_tokens_total"] > 0


@pytest.fixture(scope="module")
def v4_dir(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v4")
    save_tiny_deepseek_v4(path, seed=11, vocab_size=49152, max_position_embeddings=1024, mtp_layers=1)
    copy_tokenizer(smollm2_path, path)
    return path


# exact replay: a prefix hit or a retracted request's return rebuilds V4's ring and tails from position 0
# (bounded replay is close to, not equal to, a cold run, and the two servers hit the cache differently)
V4_FLAGS = ("--swa-replay-exact",)


@pytest.fixture(scope="module")
def v4_plain(v4_dir, server_runner, tmp_path_factory):
    with serve(server_runner, tmp_path_factory.mktemp("plain"), v4_dir, *V4_FLAGS) as s:
        return answers(s.base_url)


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
@pytest.mark.parametrize("drafter", ["mtp", "dspark", "ngram"])
def test_deepseek_v4_greedy_answers_equal_the_plain_servers(
    v4_dir, v4_plain, server_runner, tmp_path, drafter, flags
):
    small = "--max-total-tokens" in flags
    spec = spec_flags(drafter)
    with serve(server_runner, tmp_path, v4_dir, *V4_FLAGS, *spec, *flags) as s:
        got = answers(s.base_url, 2 * MAX_TOKENS if small else MAX_TOKENS)
        m = s.wait_idle()
    for i, (want, have) in enumerate(zip(v4_plain, got, strict=True)):
        assert have[:MAX_TOKENS] == want, f"prompt {i}: {have!r} != {want!r}"
    assert m["conduit_spec_draft_tokens_total"] > 0 and m["conduit_spec_verify_steps_total"] > 0
    if small:
        assert m["conduit_engine_retractions_total"] > 0

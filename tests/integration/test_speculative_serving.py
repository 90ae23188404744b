"""Speculative decoding through `conduit serve` with the real SmolLM2 and the real `openai` client:
greedy answers equal the plain server's token for token with the n-gram drafter on, with overlap on
and off, the radix cache on and off, and in a pool small enough to retract requests; /metrics shows the
drafts verified and accepted, and with overlap on the verify rows planned ahead of their previous verify
step's counts."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

# Repetitive prompts: the n-gram drafter finds continuations in them (and in the answers' own loops).
PROMPTS = [
    "Count: one two three four, one two three four, one two three four, one two three",
    "Repeat the sentence five times: The cat sat on the mat. The cat sat on the mat. The cat sat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "A, B, C, D, E, F, G, H, I, J, K, L, M,",
    "What is the capital of France? Answer in one sentence.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
]
MAX_TOKENS = 48
SPEC = ("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3")


def answers(base_url: str, max_tokens: int = MAX_TOKENS) -> list[list[str]]:
    """Each prompt's greedy completion, all sent at once (they batch), as the tokens' texts."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    def one(prompt: str) -> list[str]:
        r = client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return list(r.choices[0].logprobs.tokens)

    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def plain(server_runner, tmp_path_factory):
    with server_runner(tmp_path_factory.mktemp("plain")) as s:
        return answers(s.base_url)


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--disable-overlap", "--disable-radix-cache"),
        ("--max-total-tokens", "400", "--schedule-conservativeness", "0.1"),
    ],
    ids=["overlap-radix", "no-overlap-no-radix", "small-pool"],
)
def test_greedy_answers_equal_the_plain_servers(plain, server_runner, tmp_path, flags):
    # in the small pool, admission reserves 7% of each answer's length, so all six prompts start and
    # their answers (about 6 x 120 positions together) outgrow the 400 slots: requests are retracted
    # (their first MAX_TOKENS tokens are still the plain server's: greedy continues its own prefix)
    small = "--max-total-tokens" in flags
    with server_runner(tmp_path, *SPEC, *flags) as s:
        got = answers(s.base_url, 2 * MAX_TOKENS if small else MAX_TOKENS)
        m = s.wait_idle()
    for i, (want, have) in enumerate(zip(plain, got, strict=True)):
        assert have[:MAX_TOKENS] == want, f"prompt {i}: {have!r} != {want!r}"
    assert m["conduit_spec_draft_tokens_total"] > 0 and m["conduit_spec_accepted_tokens_total"] > 0
    assert m["conduit_spec_accept_length_mean"] > 1.0
    assert (m["conduit_spec_ahead_rows_total"] > 0) == ("--disable-overlap" not in flags)
    if small:
        assert m["conduit_engine_retractions_total"] > 0


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def test_structured_output_and_speculation_share_a_batch(plain, server_runner, tmp_path):
    """Constrained requests (response_format json_schema) run beside speculating ones: their JSON
    validates, the unconstrained greedy answers still equal the plain server's, and drafts were
    verified. (A constrained row decodes one token a step: its mask needs the previous token.)"""
    import json

    import jsonschema

    with server_runner(tmp_path, *SPEC) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)

        def person(who: str) -> dict:
            r = client.chat.completions.create(
                model=client.models.list().data[0].id, max_tokens=64, temperature=0,
                messages=[{"role": "user", "content": f"Describe {who} as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            )  # fmt: skip
            assert r.choices[0].finish_reason == "stop", r.choices[0]
            return json.loads(r.choices[0].message.content)

        with cf.ThreadPoolExecutor(4) as pool:
            people = [pool.submit(person, who) for who in ("a pirate", "a chef", "a nurse", "a baker")]
            got = answers(s.base_url)
            for p in people:
                jsonschema.validate(p.result(), PERSON)
        m = s.wait_idle()
    assert got == plain
    assert m["conduit_spec_accepted_tokens_total"] > 0

"""The real `openai` client against a real `conduit serve` (frontend + engine process) on loopback."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_chat_answers_paris(client):
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens >= 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_matches_non_streaming_and_reports_usage(client):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=16,
        temperature=0,
    )
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_stream_and_non_stream(client):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=8, temperature=0
    )
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    streamed = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_token_id_prompt_n_seed_stop_and_logprobs(client):
    ids = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=[504, 3437, 314], max_tokens=4, temperature=0
    )
    assert ids.usage.prompt_tokens == 3
    sampled = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", n=2, max_tokens=12, temperature=1.0, seed=7
    )
    again = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", n=2, max_tokens=12, temperature=1.0, seed=7
    )
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    stopped = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    lp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)


def test_extensions_sglang_and_vllm_clients_send(client):
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Hello",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 1, "min_p": 0.1, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 6


def test_completion_logprobs_list_the_sampled_token_outside_the_top_k(client):
    """As OpenAI: `top_logprobs` holds the k best and, when it is not among them, the sampled token."""
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Once upon a time",
        max_tokens=48,
        temperature=1.8,
        seed=7,
        logprobs=1,
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 48
    outside = 0
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == chosen
        assert len(top) in (1, 2)
        outside += len(top) == 2
    assert outside > 0  # at this temperature some sampled tokens are not the most likely

"""A tiny random DeepSeek-V3 checkpoint served by `conduit serve`: greedy text equals transformers'
`generate`, through the scheduler, the radix cache (a repeated prompt) and streaming."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from runtime.gpu.testing import copy_tokenizer, greedy_chat_texts, save_tiny_deepseek_v3

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "What is the capital of France?"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    """SmolLM2's tokenizer (ids < 49152) with a random DeepSeek-V3 of vocabulary 49152."""
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    ref = save_tiny_deepseek_v3(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_path, path)
    return path, ref


@pytest.fixture(scope="module")
def reference(tiny_dir):
    path, model = tiny_dir
    out = greedy_chat_texts(model, AutoTokenizer.from_pretrained(path), PROMPTS, MAX_TOKENS)
    assert all(len(t) > 20 for t in out), out  # the random model must actually say something
    return out


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory, server_runner):
    args = ("--model", str(tiny_dir[0]), "--served-model-name", "tiny")
    with server_runner(tmp_path_factory.mktemp("server"), *args) as s:
        yield s


def test_served_greedy_text_equals_transformers_generate(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        r = client.chat.completions.create(
            model="tiny", temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
        )
        assert r.choices[0].message.content == expected


def test_streamed_greedy_text_equals_transformers_generate(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        messages=[{"role": "user", "content": PROMPTS[1]}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference[1]

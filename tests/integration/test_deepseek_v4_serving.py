"""A tiny random DeepSeek-V4 checkpoint (sliding, CSA and HCA layers, a hash-routed MoE layer, compress
rates 4 and 8 so compression fires on chat prompts) served by `conduit serve`: greedy text equals
transformers' `generate`, sequentially, concurrently (rows decode together and are reused) and streamed.
V4 cannot reuse a cached prefix yet, so the engine serves it without the radix cache: a repeated prompt
is recomputed from scratch and reports no cached tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from runtime.gpu.testing import copy_tokenizer, greedy_chat_texts, save_tiny_deepseek_v4

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "What is the capital of France?",  # repeated: would be a prefix-cache hit on other models
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    """SmolLM2's tokenizer (ids < 49152) with a random DeepSeek-V4 of vocabulary 49152."""
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    ref = save_tiny_deepseek_v4(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_path, path)
    return path, ref


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """transformers' greedy `generate` (with its cache; it agrees with use_cache=False full forwards on
    this checkpoint, which the parity tests use as the logits oracle)."""
    path, model = tiny_dir
    # prompts longer than 4 * 8 tokens: several CSA and HCA entries, and the window slides
    out = greedy_chat_texts(model, AutoTokenizer.from_pretrained(path), PROMPTS, MAX_TOKENS, min_prompt_tokens=4 * 8)
    assert all(len(t) > 20 for t in out), out  # the random model must actually say something
    return out


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory, server_runner):
    args = ("--model", str(tiny_dir[0]), "--served-model-name", "tiny")
    with server_runner(tmp_path_factory.mktemp("server"), *args) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server, prompt: str):
    return client(server).chat.completions.create(
        model="tiny", temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
    )


def test_served_greedy_text_equals_transformers_generate(server, reference):
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        r = chat(server, prompt)
        assert r.choices[0].message.content == expected
        details = r.usage.prompt_tokens_details
        assert details is None or not details.cached_tokens  # no radix cache for V4: never a hit
    assert "radix_cache_disabled" in server.log()


def test_concurrent_greedy_text_equals_transformers_generate(server, reference):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: chat(server, p).choices[0].message.content, PROMPTS))
    assert texts == reference


def test_streamed_greedy_text_equals_transformers_generate(server, reference):
    stream = client(server).chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        messages=[{"role": "user", "content": PROMPTS[1]}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference[1]

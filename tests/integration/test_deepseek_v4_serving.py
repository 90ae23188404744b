"""A tiny random DeepSeek-V4 checkpoint (sliding, CSA and HCA layers, a hash-routed MoE layer, compress
rates 4 and 8 so compression fires on chat prompts, window 8, 4 layers) served by `conduit serve` with
the radix cache: greedy text equals transformers' `generate`, sequentially, concurrently (rows decode
together and are reused) and streamed, and every prompt after the first hits the cached chat-template
prefix (a repeated long prompt hits most of itself). The page size is raised to 8 (whole compression
windows). The main server replays 28 = layers * (window - 1) tokens before a hit, the window's receptive
field, which makes a hit exact; the default bound (the window, 8 tokens) is checked for what it
replays, not for the text (it is not exact by design; see docs/deepseek_v4.md)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from runtime.gpu.testing import copy_tokenizer, greedy_chat_texts, save_tiny_deepseek_v4

LONG = (
    "Here is a long question about the history of the sea, the ships that sailed on it, the ports they "
    "left from and the stars that guided them at night: which of them mattered most, and why?"
)
PROMPTS = [
    LONG,
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    LONG,  # repeated: a prefix-cache hit on all but the last partial page
]
MAX_TOKENS = 24
FIELD = 4 * (8 - 1)  # the window's receptive field through the 4 layers


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
    out = greedy_chat_texts(
        model, AutoTokenizer.from_pretrained(path), PROMPTS, MAX_TOKENS, min_prompt_tokens=4 * 8
    )
    assert all(len(t) > 20 for t in out), out  # the random model must actually say something
    return out


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory, server_runner):
    args = ("--model", str(tiny_dir[0]), "--served-model-name", "tiny", "--swa-replay-tokens", str(FIELD))
    with server_runner(tmp_path_factory.mktemp("server"), *args) as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(server, prompt: str):
    return client(server).chat.completions.create(
        model="tiny", temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
    )


def cached_tokens(r) -> int:
    details = r.usage.prompt_tokens_details
    return details.cached_tokens if details else 0


def test_served_greedy_text_equals_transformers_generate_with_prefix_hits(server, reference):
    replies = [chat(server, prompt) for prompt in PROMPTS]
    assert [r.choices[0].message.content for r in replies] == reference
    cached = [cached_tokens(r) for r in replies]
    assert cached[0] == 0 and all(c > 0 and c % 8 == 0 for c in cached[1:])  # the chat template, at least
    assert cached[-1] >= replies[-1].usage.prompt_tokens - 8  # the repeated long prompt: all but a page
    assert server.metrics()["conduit_swa_replay_tokens_total"] == sum(min(c, FIELD) for c in cached)
    log = server.log()
    assert "page_size_raised" in log and "swa_replay" in log


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
        messages=[{"role": "user", "content": PROMPTS[2]}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reference[2]


def test_default_bound_replays_the_window_before_each_hit(tiny_dir, tmp_path_factory, server_runner):
    with server_runner(tmp_path_factory.mktemp("bounded"), "--model", str(tiny_dir[0]), "--served-model-name",
                       "tiny") as s:  # fmt: skip
        first, again = chat(s, LONG), chat(s, LONG)
        assert cached_tokens(first) == 0 and cached_tokens(again) >= again.usage.prompt_tokens - 8
        assert again.choices[0].message.content  # the text itself is not checked (not exact by design)
        assert s.metrics()["conduit_swa_replay_tokens_total"] == 8  # one hit, the window
        assert "replayed=8" in s.log()

"""A tiny random DeepSeek-V4 checkpoint (sliding, CSA and HCA layers, a hash-routed MoE layer, compress
rates 4 and 8 so compression fires on chat prompts) served by `conduit serve`: greedy text equals
transformers' `generate`, sequentially, concurrently (rows decode together and are reused) and streamed.
V4 cannot reuse a cached prefix yet, so the engine serves it without the radix cache: a repeated prompt
is recomputed from scratch and reports no cached tokens."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer

from runtime.gpu.testing import save_tiny_deepseek_v4

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "What is the capital of France?",  # repeated: would be a prefix-cache hit on other models
]
MAX_TOKENS = 24
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    """SmolLM2's tokenizer (ids < 49152) with a random DeepSeek-V4 of vocabulary 49152."""
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    ref = save_tiny_deepseek_v4(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy(smollm2_path / name, path / name)
    return path, ref


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """transformers' greedy `generate` (with its cache; it agrees with use_cache=False full forwards on
    this checkpoint, which the parity tests use as the logits oracle)."""
    path, model = tiny_dir
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for p in PROMPTS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        assert ids.shape[1] > 4 * 8  # several CSA and HCA entries, the window slides
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
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

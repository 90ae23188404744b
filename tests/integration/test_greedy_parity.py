"""Greedy text from the server equals transformers' `generate` on the same model (an oracle nobody here
wrote)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.gpu.testing import greedy_chat_texts

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    return greedy_chat_texts(model, tok, PROMPTS, MAX_TOKENS)


def test_server_greedy_text_equals_transformers_generate(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": prompt}],
        )
        assert r.choices[0].message.content == expected

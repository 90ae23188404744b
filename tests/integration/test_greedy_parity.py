"""Greedy text from the server equals transformers' `generate` on the same model (an oracle nobody here
wrote)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

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
    out = []
    for p in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def test_server_greedy_text_equals_transformers_generate(server, reference):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=MAX_TOKENS,
                                           messages=[{"role": "user", "content": prompt}])
        assert r.choices[0].message.content == expected

"""Tensor parallelism over two CPU ranks (gloo): `conduit serve --tp-size 2` on SmolLM2 gives the greedy
text of one rank and of transformers' `generate`. SmolLM2's 9 heads and 3 KV heads split unevenly (two
KV groups on rank 0, one on rank 1), so the uneven split is what this proves."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.gpu.testing import greedy_chat_texts

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 16
FLAGS = ("--cpu-threads", "1", "--max-total-tokens", "4096", "--max-running-requests", "8")


@pytest.fixture(scope="module")
def reference(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()
    return greedy_chat_texts(model, tok, PROMPTS, MAX_TOKENS)


def _texts(server) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": prompt}],
        )
        out.append(r.choices[0].message.content)
    return out


def test_tp2_greedy_text_equals_one_rank_and_transformers(launch_server, reference):
    with launch_server("--tp-size", "2", *FLAGS) as tp2:
        assert "ranks=2" in tp2.log() or "distributed_ready" in tp2.log()
        two = _texts(tp2)
    with launch_server(*FLAGS) as tp1:
        one = _texts(tp1)
    assert two == one
    assert two == reference

"""Tensor parallelism for DeepSeek-V3's dense parts over two CPU ranks: MLA heads split (q_b_proj and
kv_b_proj rows, o_proj columns summed), the dense MLP and the shared experts split, the embedding and
head split by vocabulary; the routed experts stay whole on each rank. A tiny random checkpoint served
with `--tp-size 2` gives transformers' greedy text."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from runtime.gpu.testing import copy_tokenizer, greedy_chat_texts, save_tiny_deepseek_v3

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 12
FLAGS = ("--cpu-threads", "1", "--max-total-tokens", "2048", "--max-running-requests", "8")


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v3-tp")
    ref = save_tiny_deepseek_v3(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_path, path)
    return path, ref


def test_tp2_deepseek_v3_greedy_text_equals_transformers(launch_server, tiny_dir):
    path, model = tiny_dir
    expected = greedy_chat_texts(model, AutoTokenizer.from_pretrained(path), PROMPTS, MAX_TOKENS)
    with launch_server("--model", str(path), "--served-model-name", "tiny", "--tp-size", "2", *FLAGS) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        got = [
            client.chat.completions.create(
                model="tiny", temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": p}]
            )
            .choices[0]
            .message.content
            for p in PROMPTS
        ]
    assert got == expected

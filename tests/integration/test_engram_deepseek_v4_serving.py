"""A tiny random DeepSeek-V4 with Engram on two layers, named the V4.1 way (`engram_layer_ids`, the
block's other fields in `engram`), added by `--hf-overrides` and served by `conduit serve` on the CPU:
the gating runs per mHC stream (hc_mult streams), and the device, host and split placements give the
same greedy tokens and logprobs, which differ from the model without Engram. (The layer itself is
checked against the reference with 4 streams in tests/unit/engram.)"""

from __future__ import annotations

import json

import openai
import pytest

from runtime.gpu.testing import copy_tokenizer, save_tiny_deepseek_v4

OVERRIDES = json.dumps(
    {
        "engram_layer_ids": [0, 2],
        "engram": {
            "n_embed_per_ngram": 32,
            "n_head_per_ngram": 4,
            "engram_vocab_size": [5003, 7001],
            "seed": 9,
        },
    }
)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-engram")
    save_tiny_deepseek_v4(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_path, path)
    return path


def _answers(server) -> list[tuple[str, list[float]]]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model="tiny", temperature=0, max_tokens=MAX_TOKENS, logprobs=True,
            messages=[{"role": "user", "content": prompt}],
        )  # fmt: skip
        out.append((r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]))
    return out


def _serve(server_runner, tmp_path_factory, tiny_dir, *flags: str):
    args = ("--model", str(tiny_dir), "--served-model-name", "tiny", *flags)
    with server_runner(tmp_path_factory.mktemp("server"), *args) as s:
        return _answers(s)


def test_engram_placements_agree_and_change_the_model(server_runner, tmp_path_factory, tiny_dir):
    plain = _serve(server_runner, tmp_path_factory, tiny_dir)
    runs = {
        p: _serve(
            server_runner, tmp_path_factory, tiny_dir, "--hf-overrides", OVERRIDES, "--engram-placement", p
        )
        for p in ("device", "host", "split")
    }
    assert runs["host"] == runs["device"]
    assert runs["split"] == runs["device"]
    assert all(len(text) > 5 for text, _ in runs["device"]), runs["device"]  # the model says something
    assert [lp for _, lp in runs["device"]] != [lp for _, lp in plain]

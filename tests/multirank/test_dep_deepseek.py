"""Data-parallel attention with expert parallelism (DEP) on CPU ranks (gloo): tiny random DeepSeek-V3 and
V4 served at DP=EP=2 and 4 give transformers' greedy text for a batch of mixed requests sent together
(repeated prompts for prefix hits, prompts longer than the chunked-prefill budget, and with more ranks
than concurrent requests some rank idles while others step). Redundant expert copies and a placement
rebalanced from the load the ranks measured give the same text."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from transformers import AutoTokenizer

from runtime.gpu.layers.expert_parallel import measured_load, rebalance
from runtime.gpu.testing import (
    copy_tokenizer,
    greedy_chat_texts,
    save_tiny_deepseek_v3,
    save_tiny_deepseek_v4,
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea, the wind and the long grey shore under a winter sky.",
    "What is the capital of France?",  # a prefix hit on whichever rank served the first
    "Name three colours.",
    "Write a haiku about the sea, the wind and the long grey shore under a winter sky.",
]
MAX_TOKENS = 12
FLAGS = ("--cpu-threads", "1", "--max-total-tokens", "2048", "--max-running-requests", "8")
FLAGS += ("--chunked-prefill-size", "32")  # the longer prompts prefill in two chunks


# V4: prefix hits replay the sliding window's receptive field through its 4 layers (exact; see
# tests/integration/test_deepseek_v4_serving.py)
FAMILIES = {
    "v3": (save_tiny_deepseek_v3, ()),
    "v4": (save_tiny_deepseek_v4, ("--swa-replay-tokens", str(4 * (8 - 1)))),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny_dir(request, smollm2_path, tmp_path_factory):
    save, flags = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}-dep")
    ref = save(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_path, path)
    return path, ref, flags


@pytest.fixture(scope="module")
def reference(tiny_dir):
    path, model, _ = tiny_dir
    out = greedy_chat_texts(model, AutoTokenizer.from_pretrained(path), PROMPTS, MAX_TOKENS)
    assert all(len(t) > 10 for t in out), out
    return out


def _one(server, prompt: str) -> str:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}]
    )
    return r.choices[0].message.content


def _batch(server) -> list[str]:
    """Every prompt at once."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _one(server, p), PROMPTS))


def _dep(n: int) -> tuple[str, ...]:
    return ("--tp-size", str(n), "--dp-size", str(n), "--enable-dp-attention", "--ep-size", str(n))


@pytest.mark.parametrize("ranks", [2, 4])
def test_dep_batch_equals_transformers_greedy(launch_server, tiny_dir, reference, ranks):
    args = ("--model", str(tiny_dir[0]), "--served-model-name", "tiny", *_dep(ranks), *FLAGS, *tiny_dir[2])
    with launch_server(*args) as server:
        assert _batch(server) == reference
        # one request at a time: the other ranks run idle steps beside its rank's, and each repeat is
        # routed to the rank that cached its prompt
        before = server.wait_idle()["conduit_engine_prefix_cache_hit_tokens_total"]
        assert [_one(server, p) for p in PROMPTS] == reference
        after = server.wait_idle()["conduit_engine_prefix_cache_hit_tokens_total"]
        assert after - before >= 30 * len(PROMPTS)


def test_redundant_experts_and_a_placement_rebalanced_from_measured_load_keep_the_text(
    launch_server, tiny_dir, reference, tmp_path
):
    base = ("--model", str(tiny_dir[0]), "--served-model-name", "tiny", *_dep(2), *FLAGS, *tiny_dir[2])
    loads = tmp_path / "load"
    with launch_server(*base, "--ep-num-redundant-experts", "2", "--expert-load-out", str(loads)) as server:
        assert _batch(server) == reference
        server.proc.send_signal(signal.SIGINT)  # a clean stop: each rank writes its measured load
        server.proc.wait(timeout=60)
    n = json.loads((tiny_dir[0] / "config.json").read_text())["n_routed_experts"]
    load = measured_load(loads)
    assert len(load) == n and sum(load) > 0
    placement = rebalance(load, ep_size=2, num_slots=n + 2)
    hottest = max(range(n), key=load.__getitem__)
    assert len(placement.copies()[hottest]) == 2  # the hottest expert got a copy
    path = tmp_path / "placement.json"
    path.write_text(placement.to_json())
    with launch_server(*base, "--expert-placement", str(path)) as server:
        assert _batch(server) == reference

"""Prefill/decode disaggregation on the CPU with real servers: one prefill and one decode SmolLM2
server behind `conduit gateway --pd-disaggregation` give the same greedy text as one plain server, for
each transfer backend; every KV page is back on both afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
import pytest

from loadgen.launch import free_port
from tests.integration.test_gateway import run_gateway

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers."]
OPENINGS = ["The sky is", "def fibonacci(n):"]
MAX_TOKENS = 12
BACKENDS = ["tcp", "shm", "nccl"]


@contextlib.contextmanager
def pd_pair(server_runner, tmp, backend: str, *flags: str, model_flags: tuple[str, ...] = ()) -> Iterator:
    """A prefill and a decode server using `backend`, one torch thread each."""
    port = str(free_port())
    common = ("--disaggregation-transfer-backend", backend, *model_flags, *flags)
    env = {"OMP_NUM_THREADS": "1"}
    # 16-token prefill chunks: a chat prompt's KV leaves chunk by chunk while the rest is prefilled
    chunks = ("--chunked-prefill-size", "16")
    with (
        server_runner(tmp, "--disaggregation-mode", "prefill", *chunks, *common, env=env) as prefill,
        server_runner(
            tmp, "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", port, *common, env=env
        ) as decode,
    ):
        yield prefill, decode


def pd_gateway(tmp, prefills, decodes, *flags: str):
    args = [
        "--pd-disaggregation",
        "--prefill",
        *(s.url for s in prefills),
        "--decode",
        *(s.url for s in decodes),
    ]
    return run_gateway(tmp, [], *args, *flags, healthy=len(prefills) + len(decodes))


def chat(
    client: openai.OpenAI,
    prompt: str,
    stream: bool = False,
    model: str = "SmolLM2-135M-Instruct",
    max_tokens: int = MAX_TOKENS,
) -> str:
    kw = dict(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
    )


def completion(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    kw = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))


def sampled(client: openai.OpenAI, prompt: str) -> tuple[str, list[float]]:
    """A seeded sampled completion with the logprobs of its tokens."""
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        seed=3,
        logprobs=2,
    )
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


@pytest.fixture(scope="module")
def reference(smollm2_path, server_runner, tmp_path_factory):
    """Greedy answers of one plain server."""
    with server_runner(tmp_path_factory.mktemp("plain"), env={"OMP_NUM_THREADS": "1"}) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        chats = {p: chat(client, p) for p in PROMPTS}
        completions = {p: completion(client, p) for p in OPENINGS}
        seeded = sampled(client, OPENINGS[0])
        one = chat(client, PROMPTS[0], max_tokens=1)  # the prefill's token alone
    assert all(chats.values()) and all(completions.values()) and one
    return chats, completions, seeded, one


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_servers_give_the_greedy_text_of_one_server(
    backend, reference, smollm2_path, server_runner, tmp_path
):
    chats, completions, seeded, one = reference
    with pd_pair(server_runner, tmp_path, backend) as (prefill, decode):
        with pd_gateway(tmp_path, [prefill], [decode]) as gw:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for p, want in chats.items():
                assert chat(client, p) == want
                assert chat(client, p, stream=True) == want
            for p, want in completions.items():
                assert completion(client, p) == want
                assert completion(client, p, stream=True) == want
            # seeded sampling resumes on the decode server at the second token's draw; the first
            # token's logprobs come from the prefill server, the others from the decode server
            text, logprobs = sampled(client, OPENINGS[0])
            assert text == seeded[0]
            assert logprobs == pytest.approx(seeded[1], abs=1e-3)
            assert chat(client, PROMPTS[0], max_tokens=1) == one  # ends on the decode server at once
        for s in (prefill, decode):
            m = s.wait_idle()
            assert m["conduit_kv_pages_used"] == 0
        # the prefill server generated one token per request at most, the decode server the rest (a
        # prefill answer may go uncounted: the gateway closes it once the decode answer is complete)
        requests = 2 * (len(chats) + len(completions)) + 2
        assert 0 < prefill.metrics()["conduit_generation_tokens_total"] <= requests


# ---------------------------------------------------------------- DeepSeek-V3 and V4 (tiny, random)

DS_PROMPTS = [
    "Here is a long question about the history of the sea, the ships that sailed on it and the stars "
    "that guided them at night: which of them mattered most, and why?",
    "What is the capital of France?",
]
DS_MAX_TOKENS = 16


@pytest.fixture(scope="module", params=["v3", "v4"])
def tiny_deepseek(request, smollm2_path, tmp_path_factory):
    """A tiny random DeepSeek-V3 or V4 with SmolLM2's tokenizer, and transformers' greedy texts (what
    one `conduit serve` gives: tests/integration/test_deepseek_v{3,4}_serving.py)."""
    from transformers import AutoTokenizer

    from runtime.gpu import testing

    path = tmp_path_factory.mktemp(f"tiny-deepseek-{request.param}")
    save = testing.save_tiny_deepseek_v3 if request.param == "v3" else testing.save_tiny_deepseek_v4
    model = save(path, seed=11, vocab_size=49152, max_position_embeddings=512)
    testing.copy_tokenizer(smollm2_path, path)
    # V4: prompts over 4 * 8 tokens, so compressed entries and compressor tails travel too
    want = testing.greedy_chat_texts(
        model, AutoTokenizer.from_pretrained(path), DS_PROMPTS, DS_MAX_TOKENS, min_prompt_tokens=32
    )
    assert all(len(t) > 10 for t in want), want
    return request.param, path, want


# The transports move a pool's named tensors whatever the model; SmolLM2 above runs all three. Each
# DeepSeek pool (V3's latent rows; V4's compressed entries, ring and tails) travels over one of them.
DS_BACKEND = {"v3": "tcp", "v4": "nccl"}


def test_tiny_deepseek_prefill_and_decode_give_the_greedy_text_of_one_server(
    tiny_deepseek, server_runner, tmp_path
):
    name, path, want = tiny_deepseek
    backend = DS_BACKEND[name]
    model = ("--model", str(path), "--served-model-name", "tiny")
    if (
        name == "v4"
    ):  # a repeated prompt hits the prefill's cache: replay the window's receptive field (exact)
        model += ("--swa-replay-tokens", str(4 * (8 - 1)))
    with pd_pair(server_runner, tmp_path, backend, model_flags=model) as (prefill, decode):
        with pd_gateway(tmp_path, [prefill], [decode]) as gw:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for prompt, text in zip(DS_PROMPTS, want, strict=True):
                assert chat(client, prompt, model="tiny", max_tokens=DS_MAX_TOKENS) == text, name
                assert chat(client, prompt, stream=True, model="tiny", max_tokens=DS_MAX_TOKENS) == text, name
        for s in (prefill, decode):
            assert s.wait_idle()["conduit_kv_pages_used"] == 0

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
    with (
        server_runner(tmp, "--disaggregation-mode", "prefill", *common, env=env) as prefill,
        server_runner(
            tmp, "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", port, *common, env=env
        ) as decode,
    ):
        yield prefill, decode


def chat(client: openai.OpenAI, prompt: str, stream: bool = False, model: str = "SmolLM2-135M-Instruct") -> str:
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))


def completion(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    kw = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))


@pytest.fixture(scope="module")
def reference(smollm2_path, server_runner, tmp_path_factory):
    """Greedy answers of one plain server."""
    with server_runner(tmp_path_factory.mktemp("plain"), env={"OMP_NUM_THREADS": "1"}) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        chats = {p: chat(client, p) for p in PROMPTS}
        completions = {p: completion(client, p) for p in OPENINGS}
    assert all(chats.values()) and all(completions.values())
    return chats, completions


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_and_decode_servers_give_the_greedy_text_of_one_server(
    backend, reference, smollm2_path, server_runner, tmp_path
):
    chats, completions = reference
    with pd_pair(server_runner, tmp_path, backend) as (prefill, decode):
        with run_gateway(tmp_path, [], "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url) as gw:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
            for p, want in chats.items():
                assert chat(client, p) == want
                assert chat(client, p, stream=True) == want
            for p, want in completions.items():
                assert completion(client, p) == want
                assert completion(client, p, stream=True) == want
        for s in (prefill, decode):
            m = s.wait_idle()
            assert m["conduit_kv_pages_used"] == 0
        # the decode server computed only the first token's successors: every prompt token came over
        assert decode.metrics()["conduit_prompt_tokens_total"] > 0

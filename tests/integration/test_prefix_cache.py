"""The radix prefix cache through the real server: a shared 500-token prefix is reused (and the greedy
output is the one computed without the cache), a multi-turn chat reuses its earlier turns, and /metrics
reports the hit rate and the cache sizes."""

from __future__ import annotations

import random
import time

import pytest
import requests


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory, server_runner):
    with server_runner(tmp_path_factory.mktemp("prefix")) as s:
        yield s


def complete(srv, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(f"{srv.base_url}/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, messages: list[dict], max_tokens: int = 12) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(f"{srv.base_url}/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def flush(srv) -> None:
    """The flush is answered once done (so /metrics shows it); it is refused with a 400 while requests
    run, which a just-finished request can still do for a step, so retry a little."""
    for _ in range(50):
        r = requests.post(f"{srv.url}/flush_cache", timeout=30)
        if r.status_code != 400:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_shared_500_token_prefix_is_reused_and_output_unchanged(srv):
    rng = random.Random(5)
    prefix = [rng.randrange(1000, 40000) for _ in range(500)]
    a, b = (
        prefix + [rng.randrange(1000, 40000) for _ in range(20)],
        prefix + [rng.randrange(1000, 40000) for _ in range(30)],
    )
    flush(srv)
    uncached_b = complete(srv, b)  # computed from scratch
    assert cached(uncached_b) == 0
    flush(srv)
    complete(srv, a)
    second = complete(srv, b)
    assert cached(second) >= 480
    assert second["choices"][0]["text"] == uncached_b["choices"][0]["text"]


def test_multi_turn_chat_reuses_earlier_turns(srv):
    flush(srv)
    turn1 = [
        {"role": "system", "content": "You are a concise assistant. " * 4},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    r1 = chat(srv, turn1)
    answer = r1["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And three more?"}]
    r2 = chat(srv, turn2)
    turn1_tokens = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"]
    assert cached(r2) >= r1["usage"]["prompt_tokens"]  # the whole first prompt ...
    assert cached(r2) >= turn1_tokens - 4  # ... and (re-tokenization aside) the first answer


def test_metrics_report_hit_rate_and_cache_sizes(srv):
    complete(srv, list(range(1000, 1100)))
    m = srv.metrics()
    assert 0 < m["conduit_prefix_cache_hit_rate"] <= 1
    assert m["conduit_radix_cache_evictable_tokens"] > 0
    assert m["conduit_radix_cache_protected_tokens"] == 0  # nothing running
    assert m["conduit_scheduler_steps_total"] > 0
    assert m["conduit_scheduler_plan_seconds_total"] > 0
    assert m["conduit_scheduler_wait_seconds_total"] > 0
    flush(srv)
    assert srv.metrics()["conduit_radix_cache_evictable_tokens"] == 0

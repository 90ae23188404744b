"""Every bad input gets a 4xx with an OpenAI-style error body naming the problem; the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest


def post(server, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = "/v1/chat/completions"
OK_MSGS = [{"role": "user", "content": "Hi"}]

CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, None),
    ("messages missing", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("messages wrong type", CHAT, {"messages": "hello"}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("unsupported role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("max_tokens zero", CHAT, {"messages": OK_MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens beyond context", CHAT, {"messages": OK_MSGS, "max_tokens": 10_000_000}, 400, "max_tokens"),
    ("temperature wrong type", CHAT, {"messages": OK_MSGS, "temperature": "hot"}, 400, "temperature"),
    (
        "prompt longer than context",
        "/v1/completions",
        {"prompt": "hello " * 9000, "max_tokens": 4},
        400,
        "prompt",
    ),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": OK_MSGS}, 404, "model"),
    # limits: each a 400 naming the field
    ("seed of 2**64", CHAT, {"messages": OK_MSGS, "seed": 2**64}, 400, "seed"),
    ("seed below int64", CHAT, {"messages": OK_MSGS, "seed": -(2**63) - 1}, 400, "seed"),
    ("n over the limit", CHAT, {"messages": OK_MSGS, "n": 17}, 400, "n"),
    (
        "top_logprobs over 20",
        CHAT,
        {"messages": OK_MSGS, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("logprobs over 20", "/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("17 stop strings", CHAT, {"messages": OK_MSGS, "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("a 257-character stop string", CHAT, {"messages": OK_MSGS, "stop": "x" * 257}, 400, "stop"),
    (
        "stop token id past the vocabulary",
        CHAT,
        {"messages": OK_MSGS, "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    (
        "stop token id past int64",
        CHAT,
        {"messages": OK_MSGS, "stop_token_ids": [2**70]},
        400,
        "stop_token_ids",
    ),
    ("top_k past int32", CHAT, {"messages": OK_MSGS, "top_k": 2**40}, 400, "top_k"),
    ("priority past int32", CHAT, {"messages": OK_MSGS, "priority": 2**63}, 400, "priority"),
    ("prompt token past the vocabulary", "/v1/completions", {"prompt": [1, 2**62]}, 400, "prompt"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error(server, name, path, body, status, param):
    code, payload = post(server, path, body)
    assert code == status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_body_over_the_limit_is_413_naming_it(server):
    # the default limit fits the context: 64 bytes per token of 8192, at least 1 MiB
    code, payload = post(server, "/v1/completions", {"prompt": "x" * (1 << 20), "max_tokens": 1})
    assert code == 413, payload
    assert (
        "1048576 bytes" in payload["error"]["message"] and "--max-body-bytes" in payload["error"]["message"]
    )


def test_unknown_route_is_404_and_server_still_serves(server):
    code, payload = post(server, "/v1/nothing", {})
    assert code == 404 and payload["error"]["message"]
    code, payload = post(server, CHAT, {"messages": OK_MSGS, "max_tokens": 3, "temperature": 0})
    assert code == 200 and payload["usage"]["completion_tokens"] >= 1

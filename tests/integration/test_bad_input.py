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


def test_unknown_route_is_404_and_server_still_serves(server):
    code, payload = post(server, "/v1/nothing", {})
    assert code == 404 and payload["error"]["message"]
    code, payload = post(server, CHAT, {"messages": OK_MSGS, "max_tokens": 3, "temperature": 0})
    assert code == 200 and payload["usage"]["completion_tokens"] >= 1

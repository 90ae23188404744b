"""A real `conduit serve` with the access and template flags: --api-key, --allowed-origins,
--chat-template, --reasoning-parser, --generation-config."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

KEY = "sk-test-0b3c5e"
ORIGIN = "http://ui.example"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nCustom template says: {% endif %}"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def flagged(server_runner, tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("flags")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    flags = ["--api-key", KEY, "--allowed-origins", ORIGIN, "--chat-template", str(template)]
    flags += ["--reasoning-parser", "deepseek-r1", "--generation-config", "vllm"]
    with server_runner(tmp, *flags) as s:
        yield s


def request(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_401_without_the_key_and_200_with_it(flagged):
    body = {"messages": ASK, "max_tokens": 4, "temperature": 0}
    status, headers, raw = request(f"{flagged.base_url}/chat/completions", "POST", body=body)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert request(f"{flagged.base_url}/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert request(f"{flagged.url}/metrics")[0] == 401
    assert request(f"{flagged.url}/health")[0] == 200
    status, _, raw = request(
        f"{flagged.base_url}/chat/completions", "POST", {"Authorization": f"Bearer {KEY}"}, body
    )
    assert status == 200 and json.loads(raw)["choices"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=flagged.base_url, api_key="nope", max_retries=0).models.list()


def test_cors_preflight_is_answered_for_the_allowed_origin_only(flagged):
    ask = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, headers, _ = request(f"{flagged.base_url}/chat/completions", "OPTIONS", {"Origin": ORIGIN, **ask})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = request(
        f"{flagged.base_url}/chat/completions", "OPTIONS", {"Origin": "http://evil.example", **ask}
    )
    assert status == 403 and "Access-Control-Allow-Origin" not in headers


def test_the_chat_template_flag_and_the_reasoning_parser(flagged, smollm2_path):
    client = openai.OpenAI(base_url=flagged.base_url, api_key=KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=6, temperature=0
    )
    tok = AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True)
    text = tok.apply_chat_template(ASK, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    # deepseek-r1: the answer starts inside the reasoning; SmolLM2 never closes it, so it all is reasoning
    msg = r.choices[0].message
    assert msg.reasoning_content and not msg.content
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=ASK, max_tokens=6, temperature=0, stream=True
        )
    )
    streamed = "".join(
        getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices
    )
    assert streamed == msg.reasoning_content

"""Bad input, unknown routes and engine failures become OpenAI error bodies; health, metrics, flush."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from http_fakes import MODEL, FakeEngine, run, serve

from runtime.errors import Overloaded
from runtime.http.app import build_app
from runtime.mailbox.messages import EngineStats

CHAT = "/v1/chat/completions"


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, b"{not json", 400, None),
        (CHAT, json.dumps(_chat(max_tokens="x")).encode(), 400, "max_tokens"),
        (CHAT, json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (CHAT, json.dumps(_chat(messages=[])).encode(), 400, "messages"),
        (
            CHAT,
            json.dumps(_chat(messages=[{"role": "bot", "content": "x"}])).encode(),
            400,
            "messages[0].role",
        ),
        (CHAT, json.dumps(_chat(max_tokens=0)).encode(), 400, "max_tokens"),
        (CHAT, json.dumps(_chat(model="other")).encode(), 404, "model"),
        ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    ],
)
def test_bad_input_gets_an_openai_error_body(engine: FakeEngine, path, body, status, param):
    async def go():
        async with serve(engine) as c:
            r = await c.post(path, data=body)
            assert r.status == status
            err = (await r.json())["error"]
            assert err["param"] == param and err["message"] and err["type"]

    run(go())
    assert engine.requests == []


def test_unknown_route_is_404_and_wrong_method_is_405(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            r = await c.get("/v1/nope")
            assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
            r = await c.get(CHAT)
            assert r.status == 405 and "POST" in r.headers["Allow"]
            assert "not allowed" in (await r.json())["error"]["message"]

    run(go())


def test_prompt_too_long_is_400_even_when_streaming(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            body = _chat(messages=[{"role": "user", "content": "TOO LONG"}], stream=True)
            r = await c.post(CHAT, json=body)
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"

    run(go())


def test_engine_error_mid_stream_is_an_sse_error_event_then_done(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            r = await c.post(
                CHAT, json=_chat(messages=[{"role": "user", "content": "FAIL MID"}], stream=True)
            )
            assert r.status == 200
            events = [e for e in (await r.text()).split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: ") :])["error"]["message"] == "gpu worker crashed"
            assert sum(e == "data: [DONE]" for e in events) == 1

    run(go())


def test_overloaded_maps_to_429_with_retry_after(engine: FakeEngine):
    async def overloaded(req):
        raise Overloaded("queue full", retry_after=2.5)
        yield  # pragma: no cover

    engine.generate = overloaded

    async def go():
        async with serve(engine) as c:
            r = await c.post(CHAT, json=_chat())
            assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert (await r.json())["error"]["type"] == "rate_limit_error"

    run(go())


def test_unexpected_exception_is_a_500_body_and_the_server_keeps_serving(engine: FakeEngine):
    calls = []

    async def broken(req):
        calls.append(req)
        raise RuntimeError("boom")
        yield  # pragma: no cover

    async def go():
        async with serve(engine) as c:
            real = engine.generate
            engine.generate = broken
            r = await c.post(CHAT, json=_chat())
            assert r.status == 500 and (await r.json())["error"]["type"] == "server_error"
            engine.generate = real
            r = await c.post(CHAT, json=_chat())
            assert r.status == 200

    run(go())
    assert calls


def test_health_is_503_with_the_error_when_unhealthy(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            assert (await c.get("/health")).status == 200
            engine.stats = EngineStats(
                running=0,
                waiting=0,
                kv_pages_used=0,
                kv_pages_total=1,
                healthy=False,
                error="worker 0 died: CUDA error",
            )
            r = await c.get("/health")
            assert r.status == 503 and "CUDA error" in (await r.json())["error"]["message"]

    run(go())


def test_metrics_report_requests_tokens_latency_and_engine_gauges(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            assert (await c.post(CHAT, json=_chat())).status == 200
            assert (await c.post(CHAT, json=_chat(stream=True))).status == 200
            assert (await c.post(CHAT, json=_chat(max_tokens=0))).status == 400
            text = await (await c.get("/metrics")).text()
        for line in [
            'conduit_http_requests_total{route="/v1/chat/completions",status="200"} 2.0',
            'conduit_http_requests_total{route="/v1/chat/completions",status="400"} 1.0',
            'conduit_request_finished_total{finish_reason="stop"} 2.0',
            "conduit_prompt_tokens_total 10.0",
            "conduit_generation_tokens_total 6.0",
            "conduit_prefix_cache_hit_tokens_total 4.0",
            "conduit_time_to_first_token_seconds_count 2.0",
            "conduit_inter_token_latency_seconds_count 4.0",
            "conduit_e2e_request_latency_seconds_count 2.0",
            "conduit_num_requests_running 2.0",
            "conduit_num_requests_waiting 1.0",
            "conduit_kv_pages_used 10.0",
            "conduit_kv_pages_total 100.0",
        ]:
            assert line in text, line

    run(go())


def test_flush_cache_calls_the_engine(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            r = await c.post("/flush_cache")
            assert r.status == 200

    run(go())
    assert engine.flushed == 1


def test_flush_cache_refused_while_busy_is_a_400_with_an_openai_error(engine: FakeEngine):
    engine.busy = True

    async def go():
        async with serve(engine) as c:
            r = await c.post("/flush_cache")
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "cache_busy"
            assert "running or waiting" in err["message"]
            assert (await c.get("/health")).status == 200  # still serving

    run(go())


def test_body_over_the_size_limit_is_413(engine: FakeEngine):
    async def go():
        app = build_app(engine, served_model=MODEL, max_body_bytes=1024)
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            r = await c.post(CHAT, data=json.dumps(_chat(stop=["x" * 2048])))
            assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"

    run(go())

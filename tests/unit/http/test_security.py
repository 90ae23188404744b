"""--api-key and --allowed-origins on the app: 401 without the key (OpenAI's error body), the key in
the header or the WebSocket subprotocol, public health and page; CORS preflights answered for allowed
origins only, and cross-origin WebSockets refused."""

from __future__ import annotations

import base64

import aiohttp
import openai
import pytest
from http_fakes import MODEL, FakeEngine, base_url, run, serve

from runtime.http.options import ServingOptions

KEY = "sk-conduit-test-0123456789"
OPTS = ServingOptions(api_key=KEY, allowed_origins=("http://ui.example",))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def ws_protocols(key: str) -> tuple[str, ...]:
    return ("conduit", "conduit.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("="))


def test_every_route_but_health_and_the_page_needs_the_key(engine: FakeEngine):
    async def go():
        async with serve(engine, OPTS) as c:
            for method, path in [("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                                 ("POST", "/flush_cache"), ("GET", "/v1/ws"), ("GET", "/nope")]:  # fmt: skip
                r = await c.request(method, path, json=CHAT if method == "POST" else None)
                assert r.status == 401, path
                assert r.headers["WWW-Authenticate"] == "Bearer"
                err = (await r.json())["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                r = await c.request(method, path, headers={"Authorization": "Bearer wrong"})
                assert r.status == 401, path
            for path in ["/health", "/", "/static/app.js"]:
                assert (await c.get(path)).status == 200, path
            ok = await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status == 200 and (await ok.json())["data"][0]["id"] == MODEL

    run(go())


def test_the_openai_client_with_and_without_the_key(engine: FakeEngine):
    async def go():
        async with serve(engine, OPTS) as c:
            async with openai.AsyncOpenAI(base_url=base_url(c), api_key=KEY, max_retries=0) as good:
                r = await good.chat.completions.create(model=MODEL, messages=CHAT["messages"])
                assert r.choices[0].message.content == "Hello world"
            async with openai.AsyncOpenAI(base_url=base_url(c), api_key="nope", max_retries=0) as bad:
                with pytest.raises(openai.AuthenticationError):
                    await bad.chat.completions.create(model=MODEL, messages=CHAT["messages"])

    run(go())


def test_the_websocket_takes_the_key_as_header_or_subprotocol(engine: FakeEngine):
    async def go():
        async with serve(engine, OPTS) as c:
            url = c.make_url("/v1/ws")
            async with aiohttp.ClientSession() as s:
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await s.ws_connect(url, protocols=ws_protocols("wrong"))
                assert e.value.status == 401
                async with s.ws_connect(url, protocols=ws_protocols(KEY)) as ws:
                    assert ws.protocol == "conduit"
                    await ws.send_json({"type": "generate", "id": "a", "request": CHAT})
                    frames = [await ws.receive_json() for _ in range(4)]
                    assert frames[-1]["type"] == "done"
                async with s.ws_connect(url, headers={"Authorization": f"Bearer {KEY}"}) as ws:
                    await ws.send_json({"type": "abort", "id": "nothing"})

    run(go())


def test_cors_preflight_is_answered_for_an_allowed_origin_only(engine: FakeEngine):
    async def go():
        async with serve(engine, OPTS) as c:
            ask = {
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            r = await c.options("/v1/chat/completions", headers={"Origin": "http://ui.example", **ask})
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "http://ui.example"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            r = await c.options("/v1/chat/completions", headers={"Origin": "http://evil.example", **ask})
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
            # the real request from the allowed origin carries the header, streams included
            key = {"Authorization": f"Bearer {KEY}"}
            for body in (CHAT, {**CHAT, "stream": True}):
                r = await c.post(
                    "/v1/chat/completions", json=body, headers={"Origin": "http://ui.example", **key}
                )
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://ui.example"
                await r.read()
            r = await c.post(
                "/v1/chat/completions", json=CHAT, headers={"Origin": "http://evil.example", **key}
            )
            assert "Access-Control-Allow-Origin" not in r.headers

    run(go())


def test_without_allowed_origins_no_preflight_passes_and_cross_origin_websockets_are_refused(
    engine: FakeEngine,
):
    async def go():
        async with serve(engine) as c:
            r = await c.options(
                "/v1/chat/completions",
                headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
            )
            assert r.status == 403
            async with aiohttp.ClientSession() as s:
                with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                    await s.ws_connect(c.make_url("/v1/ws"), headers={"Origin": "http://evil.example"})
                assert e.value.status == 403
                own = f"http://{c.host}:{c.port}"  # the server's own page
                async with s.ws_connect(c.make_url("/v1/ws"), headers={"Origin": own}) as ws:
                    await ws.send_json({"type": "abort", "id": "x"})

    run(go())

"""GET /v1/ws: requests multiplexed by id, abort by id, one final message per id, close aborts all."""

from __future__ import annotations

from http_fakes import FakeEngine, run, serve


def _gen(cid: str, prompt: str, endpoint: str = "chat", **kw) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt}
    return {"type": "generate", "id": cid, "endpoint": endpoint, "request": {**body, **kw}}


async def _finals(ws, want: int) -> tuple[dict[str, str], dict[str, dict]]:
    """Read until `want` final messages; return the streamed text and the final message per id."""
    text: dict[str, str] = {}
    finals: dict[str, dict] = {}
    while len(finals) < want:
        m = await ws.receive_json()
        assert m["id"] not in finals, f"message after the final one: {m}"
        if m["type"] == "delta":
            text[m["id"]] = text.get(m["id"], "") + m["text"]
        else:
            finals[m["id"]] = m
    return text, finals


def test_two_requests_multiplexed_and_a_third_aborted(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, c.ws_connect("/v1/ws") as ws:
            await ws.send_json(_gen("c", "HANG"))
            await engine.started.wait()
            await ws.send_json(_gen("a", "hi"))
            await ws.send_json(_gen("b", "hi", endpoint="completions", max_tokens=8))
            await ws.send_json({"type": "abort", "id": "c"})
            text, finals = await _finals(ws, 3)
        assert text == {"a": "Hello world", "b": "Hello world"}
        assert finals["a"]["type"] == "done" and finals["a"]["finish_reason"] == "stop"
        assert finals["a"]["usage"]["completion_tokens"] == 3
        assert finals["b"]["finish_reason"] == "stop"
        assert finals["c"] == {**finals["c"], "type": "done", "finish_reason": "abort"}
        assert engine.aborted == [engine.requests[0].rid]

    run(go())


def test_invalid_request_duplicate_id_and_bad_message_are_errors_for_their_id(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, c.ws_connect("/v1/ws") as ws:
            await ws.send_json(_gen("x", "hi", max_tokens=0))
            m = await ws.receive_json()
            assert (m["type"], m["id"], m["error"]["param"]) == ("error", "x", "max_tokens")
            await ws.send_str("{nope")
            m = await ws.receive_json()
            assert m["type"] == "error" and m["id"] is None
            await ws.send_json({"type": "generate", "id": "y"})
            m = await ws.receive_json()
            assert m["type"] == "error" and m["id"] == "y" and m["error"]["param"] == "request"
            await ws.send_json(_gen("d", "HANG"))
            await ws.send_json(_gen("d", "hi"))
            m = await ws.receive_json()
            assert (m["type"], m["id"], m["error"]["param"]) == ("error", "d", "id")
            await ws.send_json({"type": "abort", "id": "unknown"})  # a no-op
            await ws.send_json({"type": "abort", "id": "d"})
            m = await ws.receive_json()
            assert (m["type"], m["id"], m["finish_reason"]) == ("done", "d", "abort")

    run(go())


def test_closing_the_socket_aborts_every_live_request(engine: FakeEngine):
    async def go():
        async with serve(engine) as c:
            async with c.ws_connect("/v1/ws") as ws:
                await ws.send_json(_gen("a", "HANG AFTER ONE"))
                await ws.send_json(_gen("b", "HANG AFTER ONE"))
                seen = set()
                while len(seen) < 2:
                    seen.add((await ws.receive_json())["id"])
            while len(engine.aborted) < 2:
                engine.abort_seen.clear()
                await engine.abort_seen.wait()

    run(go())
    assert sorted(engine.aborted) == sorted(r.rid for r in engine.requests)


def test_n_and_logprobs_over_websocket(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, c.ws_connect("/v1/ws") as ws:
            await ws.send_json(_gen("a", "hi", n=2, logprobs=True))
            deltas = []
            while (m := await ws.receive_json())["type"] == "delta":
                deltas.append(m)
        assert sorted({d["index"] for d in deltas}) == [0, 1]
        assert deltas[0]["logprobs"]["content"][0]["token"] == "Hel"
        assert m["finish_reasons"] == ["stop", "stop"] and m["usage"]["completion_tokens"] == 6

    run(go())


def test_abort_right_after_generate_still_ends_with_one_done(engine: FakeEngine):
    async def go():
        async with serve(engine) as c, c.ws_connect("/v1/ws") as ws:
            await ws.send_json(_gen("q", "HANG"))
            await ws.send_json({"type": "abort", "id": "q"})
            await ws.send_json(_gen("r", "hi"))
            _, finals = await _finals(ws, 2)
        assert finals["q"]["finish_reason"] == "abort" and finals["r"]["finish_reason"] == "stop"

    run(go())

"""Schema fuzzing against a real server: schemathesis generates requests for every route of the server's
own /openapi.json, valid ones and ones that break the schema (wrong types, missing fields, bad JSON,
odd path parameters), and they are sent in concurrent batches. Not one may get a 5xx, and every answer
must decode as the response model the document names (so the document and the handlers agree). Then the
server still serves a normal request and every KV page is back. The counts are printed.

The server runs with a short context (--max-model-len 40), so the valid generation requests stay short."""

from __future__ import annotations

import asyncio
import collections
import json
import threading

import aiohttp
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from runtime.http import openapi

BATCH = 32  # requests sent at once (the engine batches the valid ones)
REQUESTS = 1024
TIMEOUT = aiohttp.ClientTimeout(total=180)

# the model each 2xx JSON answer must decode as, by route
OK_BODY = {
    "/v1/chat/completions": openapi.ChatCompletion,
    "/v1/completions": openapi.Completion,
    "/v1/models": openapi.ModelList,
    "/v1/models/{model}": openapi.ModelCard,
    "/health": openapi.Health,
    "/flush_cache": openapi.Status,
}
CHUNK = {"/v1/chat/completions": openapi.ChatCompletionChunk, "/v1/completions": openapi.Completion}


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory, server_runner):
    args = ["--max-model-len", "40", "--max-queued-requests", "256", "--max-total-tokens", "8192"]
    args += ["--max-requests-per-websocket", "4"]
    with server_runner(tmp_path_factory.mktemp("fuzz"), *args) as s:
        yield s


def _check_answer(path: str, status: int, content_type: str, body: bytes) -> str | None:
    """Why the answer breaks the contract, or None."""
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if path in ("/metrics", "/openapi.json") and status == 200:
        return None
    if content_type == "text/event-stream":
        for line in body.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            model = openapi.ErrorResponse if "error" in event else CHUNK[path]
            msgspec.convert(event, model)
        if not body.rstrip().endswith(b"data: [DONE]"):
            return "stream without [DONE]"
        return None
    model = OK_BODY.get(path) if status < 300 else openapi.ErrorResponse
    if model is None:
        return f"unexpected status {status}"
    try:
        msgspec.json.decode(body, type=model)
    except msgspec.ValidationError as e:
        return f"{status} does not match {model.__name__}: {e}: {body[:300]!r}"
    return None


async def _send(session: aiohttp.ClientSession, url: str, case) -> tuple[str, int, str | None]:
    kw = case.as_transport_kwargs(base_url=url)
    headers = {k: v for k, v in kw["headers"].items() if k.lower() not in ("connection", "accept-encoding")}
    payload = {"json": kw["json"]} if "json" in kw else {"data": kw.get("data")}
    async with session.request(kw["method"], kw["url"], headers=headers, params=kw["params"], **payload) as r:
        body = await r.read()
        return (
            case.operation.path,
            r.status,
            _check_answer(case.operation.path, r.status, r.content_type, body),
        )


def test_a_thousand_generated_requests_get_no_5xx_and_match_the_document(srv):
    document = json.loads(aiohttp_get(srv.url + "/openapi.json"))
    schema = schemathesis.openapi.from_dict(document)
    operations = [r.ok() for r in schema.get_all_operations() if r.ok().path != "/v1/ws"]
    assert {op.path for op in operations} == set(document["paths"]) - {"/v1/ws"}
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations for mode in GenerationMode])
    counts: collections.Counter[tuple[str, int]] = collections.Counter()
    broken: list[str] = []

    # hypothesis draws the cases one by one; a loop on another thread keeps BATCH of them in flight
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    session = asyncio.run_coroutine_threadsafe(_session(), loop).result()
    slots = threading.BoundedSemaphore(BATCH)

    def record(future) -> None:
        slots.release()
        try:
            path, status, problem = future.result()
        except Exception as e:  # a timeout or a dropped connection is a failure too
            path, status, problem = "?", 0, repr(e)
        counts[(path, status)] += 1
        if problem is not None:
            broken.append(f"{path}: {problem}")

    @given(cases)
    @settings(
        max_examples=REQUESTS,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        slots.acquire()
        asyncio.run_coroutine_threadsafe(_send(session, srv.url, case), loop).add_done_callback(record)

    try:
        fuzz()
        for _ in range(BATCH):  # every request answered
            slots.acquire()
    finally:
        asyncio.run_coroutine_threadsafe(session.close(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    total = sum(counts.values())
    by_route = collections.Counter()
    for (path, _), n in counts.items():
        by_route[path] += n
    print(f"\nschema fuzzing: {total} requests, {sum(n for (_, s), n in counts.items() if s >= 500)} 5xx")
    for (path, status), n in sorted(counts.items()):
        print(f"  {path:24s} {status}  {n}")
    assert not broken, broken[:10]
    assert total >= REQUESTS * 0.95 and set(by_route) == {op.path for op in operations}
    ok = json.loads(aiohttp_post(srv.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3}))
    assert ok["usage"]["completion_tokens"] == 3
    srv.wait_idle()


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=BATCH))


def aiohttp_get(url: str) -> bytes:
    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as r:
            assert r.status == 200
            return await r.read()

    return asyncio.run(go())


def aiohttp_post(url: str, body: dict) -> bytes:
    async def go():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url, json=body) as r:
            assert r.status == 200, await r.text()
            return await r.read()

    return asyncio.run(go())


# ---------------------------------------------------------------- the WebSocket

IDS = st.sampled_from(["a", "b", "c"])  # few ids: duplicates and aborts of live ids are frequent
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["type", "request", "endpoint", "x"]), inner, max_size=4)
    ),
    max_leaves=12,
)
ENDINGS = ("read_all", "slow_read", "close", "drop", "half_close")


def _ws_actions(schema):
    bodies = st.one_of(
        [
            schema[path]["POST"]
            .as_strategy(generation_mode=mode)
            .map(lambda case, ep=endpoint: (ep, case.as_transport_kwargs(base_url="http://x")))
            for path, endpoint in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"))
            for mode in GenerationMode
        ]
    )
    return st.one_of(
        st.tuples(st.just("generate"), IDS, bodies),
        st.tuples(st.just("abort"), IDS),
        st.tuples(st.just("text"), st.text(max_size=40)),  # malformed JSON, mostly
        st.tuples(st.just("text"), JSON_VALUES.map(json.dumps)),  # JSON of the wrong shape or types
        st.tuples(st.just("binary"), st.binary(max_size=40)),
        st.integers(0, 24).map(
            lambda k: ("huge", (1 << 20) + 1) if k == 0 else ("huge", 5 << 20) if k == 1 else ("abort", "z")
        ),
    )


def _frame(action) -> str | bytes:
    kind = action[0]
    if kind == "generate":
        _, cid, (endpoint, kw) = action
        request = json.dumps(kw["json"]) if "json" in kw else (kw.get("data") or b"").decode(errors="replace")
        return f'{{"type": "generate", "id": "{cid}", "endpoint": "{endpoint}", "request": {request}}}'
    if kind == "abort":
        return json.dumps({"type": "abort", "id": action[1]})
    if kind == "huge":
        return "x" * action[1]
    return action[1]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def _ws_session(url: str, actions: list, ending: str) -> tuple[list[str], int]:
    """Play one socket; the problems found and the frames received."""
    problems: list[str] = []
    # each generate message that is JSON gets exactly one final frame (done, or error) under its id
    expected = collections.Counter(a[1] for a in actions if a[0] == "generate" and _is_json(_frame(a)))
    finals: collections.Counter[str] = collections.Counter()
    frames = 0
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.ws_connect(f"{url}/v1/ws") as ws:
        for action in actions:
            frame = _frame(action)
            try:
                if isinstance(frame, bytes):
                    await ws.send_bytes(frame)
                else:
                    await ws.send_str(frame)
            except ConnectionError:
                # over 4x the limit the server closes the socket (1009), maybe before all of it is sent
                if action[0] == "huge" and action[1] > 4 << 20:
                    return problems, frames
                raise
        if ending == "close":
            return problems, frames
        if ending == "drop":
            ws._response.connection.transport.abort()
            return problems, frames
        if ending == "half_close":
            ws._response.connection.transport.write_eof()  # the server sees the end of our stream
        while finals != expected:
            msg = await ws.receive(timeout=120)
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                if ending != "half_close" and ws.close_code != 1009:
                    problems.append(f"closed with {ws.close_code} before every final frame")
                break
            frames += 1
            frame = json.loads(msg.data)
            model = {"delta": openapi.WsDelta, "done": openapi.WsDone, "error": openapi.WsError}[
                frame["type"]
            ]
            msgspec.convert(frame, model)
            if frame["type"] == "error" and frame["error"]["type"] == "server_error":
                problems.append(f"server error: {frame}")
            if frame["type"] in ("done", "error") and frame["id"] in expected:
                finals[frame["id"]] += 1
            if ending == "slow_read":
                await asyncio.sleep(0.01)  # a slow reader (load shaping, not synchronisation)
        if ending == "read_all" and any(finals[i] > n for i, n in expected.items()):
            problems.append(f"more than one final frame per generate: {finals} for {expected}")
    return problems, frames


def test_websocket_fuzz_never_breaks_the_server_and_frees_every_aborted_request(srv):
    schema = schemathesis.openapi.from_dict(json.loads(aiohttp_get(srv.url + "/openapi.json")))
    sessions = st.tuples(st.lists(_ws_actions(schema), min_size=1, max_size=8), st.sampled_from(ENDINGS))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    slots = threading.BoundedSemaphore(8)
    problems: list[str] = []
    kinds: collections.Counter[str] = collections.Counter()
    frames = [0]

    def record(future) -> None:
        slots.release()
        try:
            found, n = future.result()
        except Exception as e:
            found, n = [f"{e!r} in {future.session}"], 0
        problems.extend(found)
        frames[0] += n

    @given(sessions)
    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(session):
        actions, ending = session
        kinds.update(a[0] for a in actions)
        kinds[ending] += 1
        slots.acquire()
        future = asyncio.run_coroutine_threadsafe(_ws_session(srv.url, actions, ending), loop)
        future.session = ([a[:2] if a[0] != "generate" else (*a[:2], a[2][0]) for a in actions], ending)
        future.add_done_callback(record)

    try:
        fuzz()
        for _ in range(8):
            slots.acquire()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    messages = sum(v for k, v in kinds.items() if k not in ENDINGS)
    print(
        f"\nwebsocket fuzzing: {sum(kinds[e] for e in ENDINGS)} sockets, {messages} messages, {frames[0]} frames back"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    assert not problems, problems[:10]
    ok = json.loads(aiohttp_post(srv.url + "/v1/completions", {"prompt": "Hi", "max_tokens": 3}))
    assert ok["usage"]["completion_tokens"] == 3
    m = srv.wait_idle()  # every request of a closed, dropped or half-closed socket was aborted
    assert m["conduit_http_requests_in_flight"] == 0


def test_websocket_limits_are_errors_naming_the_limit(srv):
    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.ws_connect(f"{srv.url}/v1/ws") as ws:
            request = {"prompt": "Count", "max_tokens": 30, "ignore_eos": True}
            for i in range(5):
                await ws.send_json(
                    {"type": "generate", "id": str(i), "endpoint": "completions", "request": request}
                )
            await ws.send_str("x" * ((1 << 20) + 1))
            frames = []
            while len([f for f in frames if f["type"] in ("done", "error")]) < 6:
                frames.append(await ws.receive_json(timeout=120))
            return frames

    frames = asyncio.run(main())
    errors = [f for f in frames if f["type"] == "error"]
    assert [e["id"] for e in errors] == ["4", None], errors
    assert (
        errors[0]["error"]["code"] == "too_many_requests_on_socket"
        and "4 live" in errors[0]["error"]["message"]
    )
    assert (
        errors[1]["error"]["code"] == "message_too_large" and "1048576 bytes" in errors[1]["error"]["message"]
    )
    assert len([f for f in frames if f["type"] == "done"]) == 4

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
REQUESTS = 2048
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


def test_thousands_of_generated_requests_get_no_5xx_and_match_the_document(srv):
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
    assert total >= 2000 and set(by_route) == {op.path for op in operations}
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

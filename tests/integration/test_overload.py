"""Overload against a real server: offered load far above capacity is refused with 429 and Retry-After,
every request that is served is correct, and the server's memory stays bounded (the RSS of the server
and its engine process is printed). One huge request in flight (a body at the size limit, tokenized off
the event loop) leaves /health answering at once and small requests at their normal latency."""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import psutil
import pytest

TIMEOUT = aiohttp.ClientTimeout(total=300)
PROMPTS = [f"Question {i}: what comes after {i}?" for i in range(5)]


@pytest.fixture(scope="module")
def srv(smollm2_path, tmp_path_factory, server_runner):
    # one engine thread: on a 2-core machine a 2-thread engine slows down 20x whenever anything else
    # (here the huge prompts' tokenization) takes a core, whatever the frontend does (docs/PERF.md)
    args = ["--max-running-requests", "4", "--max-queued-requests", "8", "--cpu-threads", "1"]
    with server_runner(tmp_path_factory.mktemp("overload"), *args) as s:
        yield s


def _rss_mib(server) -> float:
    procs = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20


def _body(i: int) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with s.post(f"{url}/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json()


def test_load_far_above_capacity_gets_429_with_retry_after_and_correct_answers(srv):
    async def burst(n: int):
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*(_post(s, srv.url, _body(i)) for i in range(n)))

    async def solo():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            return [(await _post(s, srv.url, _body(i)))[2]["choices"][0]["text"] for i in range(len(PROMPTS))]

    expected = asyncio.run(solo())
    rss = [_rss_mib(srv)]
    served = refused = 0
    for _ in range(3):  # 3 bursts of 150 at once: 4 run, 8 wait, the rest are refused
        for i, (status, headers, body) in enumerate(asyncio.run(burst(150))):
            assert status in (200, 429), (status, body)
            if status == 429:
                refused += 1
                assert int(headers["Retry-After"]) >= 1 and body["error"]["type"] == "rate_limit_error"
            else:
                served += 1
                assert body["choices"][0]["text"] == expected[i % len(PROMPTS)]
                assert body["usage"]["completion_tokens"] == 8
        srv.wait_idle()
        rss.append(_rss_mib(srv))
    print(
        f"\noverload: 450 offered, {served} served, {refused} refused with 429; RSS MiB {[round(r) for r in rss]}"
    )
    assert served >= 12 and refused >= 300
    assert rss[-1] - rss[1] < 100, rss  # after the first burst warmed everything up, no growth


def test_one_huge_request_leaves_health_and_small_requests_at_normal_latency(srv):
    # ~1 MB of text (the body limit): ~300k tokens, far over the context, found only by tokenizing it
    huge = {"prompt": " ".join(str(i) for i in range(150_000))[:1_000_000], "max_tokens": 4}

    async def timed(s, method, path, body=None) -> float:
        t0 = time.monotonic()
        async with s.request(method, f"{srv.url}{path}", json=body) as r:
            await r.read()
            assert r.status == 200, await r.text()
        return time.monotonic() - t0

    async def main():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            small = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
            alone = [await timed(s, "POST", "/v1/completions", small) for _ in range(3)]
            big = [asyncio.create_task(_post(s, srv.url, huge)) for _ in range(6)]
            await asyncio.sleep(0)  # the huge bodies start going out first
            health = [await timed(s, "GET", "/health") for _ in range(3)]
            during = [await timed(s, "POST", "/v1/completions", small) for _ in range(2)]
            pending = sum(not t.done() for t in big)
            answers = await asyncio.gather(*big)
            return alone, health, during, pending, answers

    alone, health, during, pending, answers = asyncio.run(main())
    print(f"\nwith 6 huge requests in flight: /health {max(health):.3f} s, small request "
          f"{statistics.median(during):.3f} s (alone {statistics.median(alone):.3f} s)")  # fmt: skip
    assert pending > 0  # the measurements overlapped the huge requests' tokenization
    for status, _, body in answers:
        assert status == 400 and body["error"]["param"] == "prompt"
    assert max(health) < 0.5
    assert statistics.median(during) < 2 * statistics.median(alone) + 0.5

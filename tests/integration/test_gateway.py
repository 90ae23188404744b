"""`conduit gateway` in front of three real SmolLM2 replicas on the CPU, driven by real clients: the
`openai` client and a WebSocket give what a direct server gives; a shared prefix goes where it is
cached; workers come and go at run time; a worker killed mid-stream fails its request with a clear
error and the others take the new ones. Every process is stopped by its fixture, even on failure.

The replicas are shared by the module; the last test kills two of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from loadgen.launch import Launched, free_port

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "Name three primary colors."]
OPENINGS = ["The sky is", "Once upon a time", "def fibonacci(n):"]  # completion prompts
MAX_TOKENS = 8


@dataclass
class Gateway(Launched):
    def get(self, path: str) -> tuple[int, dict]:
        return self.call("GET", path)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def workers(self) -> dict[str, dict]:
        return {w["url"]: w for w in self.get("/workers")[1]["workers"]}

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def sent(self, worker: str, endpoint: str) -> float:
        return self.metrics().get(
            f'conduit_gateway_requests_total{{endpoint="{endpoint}",worker="{worker}"}}', 0
        )

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Poll `cond` (the gateway's state has no event to wait on) until true, or fail at the deadline."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, f"gateway exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.workers()}"
            time.sleep(0.05)


@contextlib.contextmanager
def run_gateway(
    tmp_dir: Path, workers: list[str], *flags: str, healthy: int | None = None
) -> Iterator[Gateway]:
    """`conduit gateway` over `workers`, yielded once it answers and `healthy` (default: all) workers
    are healthy; stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "runtime.cli", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", *workers, *flags]
    log_path = tmp_dir / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log_path)
    try:

        def ready() -> bool:
            try:
                states = gw.workers()
            except OSError:
                return False
            return sum(w["healthy"] for w in states.values()) == (
                len(workers) if healthy is None else healthy
            )

        gw.wait_for(ready, "the gateway and its workers", timeout=30)
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def replicas(smollm2_path, server_runner, tmp_path_factory):
    """Three `conduit serve` processes, started together, one torch thread each (three replicas with
    torch's default of one thread per core wait on each other's barriers on a 2-core machine)."""
    tmp = tmp_path_factory.mktemp("replicas")
    managers = [server_runner(tmp) for _ in range(3)]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(3) as pool:
        with pytest.MonkeyPatch.context() as env:  # read when each process starts
            env.setenv("OMP_NUM_THREADS", "1")
            futures = [pool.submit(cm.__enter__) for cm in managers]
            for f in futures:
                with contextlib.suppress(BaseException):
                    f.exception()  # waits for the start, failed or not
        servers, errors = [], []
        for cm, f in zip(managers, futures, strict=True):
            try:
                servers.append(f.result())
                stack.push(cm.__exit__)
            except BaseException as e:  # the others still stop, through the stack
                errors.append(e)
        if errors:
            raise errors[0]
        yield servers


def urls(servers) -> list[str]:
    return [s.url for s in servers]


def chat(
    client: openai.OpenAI,
    prompt: str,
    stream: bool = False,
    system: str | None = None,
    max_tokens: int = MAX_TOKENS,
):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    kw = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw)
    return "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
    )


def completion(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    kw = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))


def test_openai_client_through_the_gateway_matches_a_direct_server(replicas, tmp_path):
    direct = openai.OpenAI(base_url=replicas[0].base_url, api_key="unused", max_retries=0)
    with run_gateway(tmp_path, urls(replicas), "--policy", "round_robin") as gw:
        via = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        for p in PROMPTS:
            want = chat(direct, p).choices[0].message.content
            assert want
            assert chat(via, p).choices[0].message.content == want
            assert chat(via, p, stream=True) == want
        for p in OPENINGS:
            want = completion(direct, p)
            assert want
            assert completion(via, p) == want
            assert completion(via, p, stream=True) == want
        assert [m.id for m in via.models.list().data] == [m.id for m in direct.models.list().data]
        for s in replicas:  # round robin spread the 12 generations: every replica answered some
            assert gw.sent(s.url, "chat") + gw.sent(s.url, "completions") >= 3
        assert sum(w["load"] for w in gw.workers().values()) == 0


def test_websocket_through_the_gateway_routes_each_request_and_follows_aborts(replicas, tmp_path):
    direct = openai.OpenAI(base_url=replicas[0].base_url, api_key="unused", max_retries=0)
    want = {f"r{i}": completion(direct, p) for i, p in enumerate(OPENINGS)}
    assert all(want.values())

    async def go(url: str) -> tuple[dict, dict]:
        text: dict[str, str] = {}
        finals: dict[str, dict] = {}
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{url}/v1/ws") as ws:
            long = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
            await ws.send_json({"type": "generate", "id": "long", "endpoint": "completions", "request": long})
            for i, p in enumerate(OPENINGS):
                body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
                await ws.send_json(
                    {"type": "generate", "id": f"r{i}", "endpoint": "completions", "request": body}
                )
            await ws.send_json(
                {"type": "generate", "id": "bad", "request": {"messages": [], "max_tokens": 0}}
            )
            await ws.send_json({"type": "abort", "id": "nobody"})  # unknown: nothing happens
            await ws.send_str("not json")
            while len(finals) < 6:
                m = await ws.receive_json(timeout=120)
                if m["type"] == "delta":
                    text[m["id"]] = text.get(m["id"], "") + m["text"]
                    if m["id"] == "long" and len(text["long"]) > 0:
                        await ws.send_json({"type": "abort", "id": "long"})
                else:
                    assert m["id"] not in finals, m
                    finals[m["id"]] = m
        return text, finals

    with run_gateway(tmp_path, urls(replicas)) as gw:
        text, finals = asyncio.run(go(gw.url))
        assert {k: text.get(k) for k in want} == want
        assert all(finals[k]["type"] == "done" for k in want)
        assert finals["long"]["type"] == "done" and finals["long"]["finish_reason"] == "abort"
        assert finals["bad"]["type"] == "error" and finals["bad"]["error"]["type"] == "invalid_request_error"
        assert finals[None]["error"]["code"] == "invalid_json"  # a worker's answer, passed through
        # per request: the requests in flight together went to different workers (least loaded)
        assert sum(gw.sent(s.url, "ws") > 0 for s in replicas) >= 2
        gw.wait_for(lambda: sum(w["load"] for w in gw.workers().values()) == 0, "loads back to 0")


def _system_prompt(rng: random.Random) -> str:
    words = ["river", "stone", "cloud", "amber", "quiet", "lantern", "harbor", "meadow", "copper", "willow"]
    return " ".join(rng.choice(words) for _ in range(60))


def test_cache_aware_sends_a_shared_prefix_where_it_is_cached_and_round_robin_does_not(replicas, tmp_path):
    rng = random.Random(time.time_ns())  # prefixes no replica has seen, run after run
    questions = ["Summarize.", "What is it about?", "Give it a title."]

    def cached_shares(gw: Gateway) -> list[float]:
        """Two system prompts, their questions interleaved (A B A B A B): cached / prompt tokens of each
        request after the first of its group."""
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        systems = [_system_prompt(rng), _system_prompt(rng)]
        shares = []
        for i, q in enumerate(questions * 2):
            usage = chat(client, q, system=systems[i % 2], max_tokens=1).usage
            if i >= 2:
                shares.append(usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens)
        return shares

    with run_gateway(tmp_path, urls(replicas), "--policy", "cache_aware") as gw:
        assert min(cached_shares(gw)) > 0.7  # every repeat of a group found its prefix cached
        m = gw.metrics()
        assert m['conduit_gateway_routing_decisions_total{kind="cache_hit",policy="cache_aware"}'] == 4
        assert m['conduit_gateway_routing_decisions_total{kind="fallback",policy="cache_aware"}'] == 2
    with run_gateway(tmp_path, urls(replicas), "--policy", "round_robin") as gw:
        assert max(cached_shares(gw)) < 0.5  # A, B, A, B, ... over three workers: never where it was


def test_workers_are_added_and_removed_at_run_time(replicas, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    a, b = replicas[0].url, replicas[1].url
    with run_gateway(tmp_path, [dead], "--policy", "round_robin", healthy=0) as gw:
        status, body = gw.get("/health")
        assert status == 503 and body["error"]["code"] == "no_healthy_worker"
        status, body = gw.call("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "no_healthy_worker"

        status, body = gw.call("POST", "/workers", {"url": a})
        assert status == 200 and body["healthy"]
        status, body = gw.call("POST", "/workers", {"url": b + "/v1"})
        assert status == 200 and body["url"] == b and body["healthy"]
        assert gw.get("/health") == (200, {"status": "ok", "healthy_workers": 2})
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        for _ in range(4):
            assert completion(client, "Hello")
        assert (
            gw.sent(a, "completions") == 2
            and gw.sent(b, "completions") == 2
            and gw.sent(dead, "completions") == 0
        )

        assert gw.call("DELETE", "/workers", {"url": a})[0] == 200
        for _ in range(2):
            assert completion(client, "Hello")
        assert gw.sent(a, "completions") == 2 and gw.sent(b, "completions") == 4
        assert list(gw.workers()) == [dead, b]

        status, body = gw.call("DELETE", "/workers", {"url": a})
        assert status == 404 and body["error"]["param"] == "url"
        assert gw.call("POST", "/workers", {"url": b})[0] == 400
        assert gw.call("POST", "/workers", {"address": b})[0] == 400
        m = gw.metrics()
        assert m[f'conduit_gateway_worker_healthy{{worker="{dead}"}}'] == 0
        assert m[f'conduit_gateway_worker_healthy{{worker="{b}"}}'] == 1
        assert m[f'conduit_gateway_requests_in_flight{{worker="{b}"}}'] == 0
        assert m['conduit_gateway_routing_decisions_total{kind="round_robin",policy="round_robin"}'] == 6


def test_a_worker_killed_mid_stream_fails_its_request_and_the_others_take_new_ones(replicas, tmp_path):
    """Runs last: it kills two of the module's replicas."""
    by_url = {s.url: s for s in replicas}
    # health checks far apart: what the gateway learns here, it learns from the traffic
    flags = ("--policy", "round_robin", "--health-check-interval-secs", "600")
    with run_gateway(tmp_path, urls(replicas), *flags) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Tell me a very long story.",
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks), next(chunks)  # it is streaming
        (victim,) = [url for url, w in gw.workers().items() if w["load"] == 1]
        os.killpg(by_url[victim].proc.pid, signal.SIGKILL)
        by_url[victim].proc.wait(30)
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        assert err.value.body["code"] == "worker_failed", err.value.body
        assert not gw.workers()[victim]["healthy"]
        for p in OPENINGS:
            assert completion(client, p)
        assert gw.sent(victim, "completions") == 1

        # a worker that dies between health checks: the request sent to it goes to another one
        survivors = [u for u in by_url if u != victim]
        second = survivors[0]
        os.killpg(by_url[second].proc.pid, signal.SIGKILL)
        by_url[second].proc.wait(30)
        for p in OPENINGS[:2]:  # round robin over the two it believes healthy: one hits the dead one
            assert completion(client, p)
        m = gw.metrics()
        assert m[f'conduit_gateway_retries_total{{worker="{second}"}}'] == 1
        assert m[f'conduit_gateway_worker_errors_total{{kind="connect",worker="{second}"}}'] == 1
        assert m[f'conduit_gateway_worker_errors_total{{kind="midstream",worker="{victim}"}}'] == 1
        assert [u for u, w in gw.workers().items() if w["healthy"]] == [survivors[1]]
        assert gw.get("/health") == (200, {"status": "ok", "healthy_workers": 1})

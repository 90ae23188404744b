"""Failures of disaggregated serving with real servers (two prefill and two decode SmolLM2 servers on
the CPU, tcp transfers): a reservation whose KV never comes fails its request after the transfer
timeout and gives its pages back; a prefill server killed mid-request, or a decode server killed
mid-stream, fails that request with a clear error, is marked unhealthy, and new requests go to the
other one; no KV page is left in use on the survivors. Runs in order: each kill test kills a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from loadgen.launch import free_port
from tests.integration.test_disaggregation import completion, pd_gateway

TIMEOUT_S = 4
LONG_PROMPT = "word " * 3000  # prefilled in 32-token chunks: the prefill takes ~100 steps


@pytest.fixture(scope="module")
def fleet(smollm2_path, server_runner, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    env = {"OMP_NUM_THREADS": "1"}
    common = ("--disaggregation-transfer-timeout", str(TIMEOUT_S))
    prefill = ("--disaggregation-mode", "prefill", "--chunked-prefill-size", "32", *common)
    managers = [server_runner(tmp, *prefill, env=env) for _ in range(2)]
    managers += [
        server_runner(
            tmp,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-bootstrap-port",
            str(free_port()),
            *common,
            env=env,
        )  # fmt: skip
        for _ in range(2)
    ]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(4) as pool:
        servers = [f.result() for f in [pool.submit(stack.enter_context, m) for m in managers]]
        yield servers[:2], servers[2:]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_reservation_whose_kv_never_arrives_fails_and_frees_its_pages(fleet):
    _, (decode, _) = fleet
    body = {"prompt": "The sky is", "max_tokens": 4, "bootstrap_room": 12345}
    status, answer = _post(f"{decode.url}/v1/completions", body)
    assert status == 504, answer
    assert "did not arrive from the prefill server" in answer["error"]["message"]
    assert decode.wait_idle()["conduit_kv_pages_used"] == 0


def test_a_request_with_the_wrong_bootstrap_fields_is_refused(fleet):
    (prefill, _), (decode, _) = fleet
    body = {"prompt": "Hi", "bootstrap_room": 1, "bootstrap_addr": "127.0.0.1:1"}
    status, answer = _post(f"{decode.url}/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "bootstrap_addr"
    status, answer = _post(f"{prefill.url}/v1/completions", {"prompt": "Hi", "bootstrap_room": 1})
    assert status == 400 and answer["error"]["param"] == "bootstrap_addr"


def _kill(server) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)


def test_a_prefill_server_killed_mid_request_fails_it_and_new_requests_go_to_the_other(fleet, tmp_path):
    prefills, decodes = fleet
    flags = ("--policy", "round_robin", "--health-check-interval-secs", "600")
    with pd_gateway(tmp_path, prefills, decodes, *flags) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(completion, client, LONG_PROMPT)
            gw.wait_for(lambda: any(w["load"] for w in gw.workers().values()), "the request to start")
            (victim,) = [s for s in prefills if gw.workers()[s.url]["load"] == 1]
            _kill(victim)
            with pytest.raises(openai.APIError) as err:
                pending.result()
        assert "prefill server" in str(err.value.body) or "Prefill" in str(err.value.body), err.value.body
        assert not gw.workers()[victim.url]["healthy"]
        for p in ["The sky is", "Once upon a time"]:  # the other prefill server takes them
            assert completion(client, p)
        for s in decodes + [s for s in prefills if s is not victim]:
            assert s.wait_idle()["conduit_kv_pages_used"] == 0


def test_a_decode_server_killed_mid_stream_fails_it_and_new_requests_go_to_the_other(fleet, tmp_path):
    prefills, decodes = fleet
    alive = [s for s in prefills if s.proc.poll() is None]
    flags = ("--health-check-interval-secs", "600")
    with pd_gateway(tmp_path, alive, decodes, *flags) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Tell me a very long story.", max_tokens=2000, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks), next(chunks)  # it is streaming from a decode server
        (victim,) = [s for s in decodes if gw.workers()[s.url]["load"] == 1]
        _kill(victim)
        with pytest.raises(openai.APIError) as err:
            for _ in chunks:
                pass
        assert err.value.body["code"] == "worker_failed", err.value.body
        assert not gw.workers()[victim.url]["healthy"]
        for p in ["The sky is", "Once upon a time"]:  # the other decode server takes them
            assert completion(client, p)
        for s in alive + [s for s in decodes if s is not victim]:
            assert s.wait_idle()["conduit_kv_pages_used"] == 0

"""`loadgen serve` and `loadgen compare` end to end against the fake server in conftest.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from loadgen.cli import main
from loadgen.metrics import LATENCIES, STATS

QUICK = ["--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
         "--disable-tqdm", "--warmup-requests", "0"]  # fmt: skip


def _run(url: str, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    rc = main(["serve", "--base-url", url, *QUICK, "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["chat", "completions", "ws"])
def test_json_has_every_metric_and_counts_match_the_server(fake_server, tmp_path, backend):
    rc, doc = _run(fake_server.url, tmp_path, "--backend", backend, "--num-prompts", "12")
    assert rc == 0
    m = doc["metrics"]
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "input_throughput", "output_throughput", "total_throughput",
                "concurrency"):  # fmt: skip
        assert key in m
    for lat in LATENCIES:
        assert set(STATS) <= set(m[f"{lat}_ms"])
    assert m["completed"] == 12 == fake_server.requests and m["failed"] == 0
    assert m["total_output_tokens"] == fake_server.completion_tokens
    assert doc["server_models"]["data"][0]["id"] == "fake-model"
    assert doc["config"]["model"] == "fake-model"
    reqs = doc["requests"]
    assert len(reqs) == 12
    for r in reqs:
        assert r["success"] and 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["completion_tokens"] == r["output_len_requested"] == r["output_chunks"]
        assert len(r["itl_s"]) == r["output_chunks"] - 1
        assert r["start_s"] <= r["end_s"]


def test_max_concurrency_is_never_exceeded(fake_server, tmp_path):
    rc, doc = _run(fake_server.url, tmp_path, "--num-prompts", "24", "--max-concurrency", "4")
    assert rc == 0 and doc["metrics"]["completed"] == 24
    assert fake_server.max_in_flight == 4
    # and from the client's own timestamps
    events = sorted(
        [(r["start_s"], 1) for r in doc["requests"]] + [(r["end_s"], -1) for r in doc["requests"]]
    )
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 4


@pytest.mark.parametrize("connections", ["1", "3"])
def test_ws_multiplexes_requests_on_shared_sockets(fake_server, tmp_path, connections):
    rc, doc = _run(fake_server.url, tmp_path, "--backend", "ws", "--ws-connections", connections,
                   "--num-prompts", "16", "--max-concurrency", "8")  # fmt: skip
    assert rc == 0 and doc["metrics"]["completed"] == 16
    assert fake_server.max_in_flight == 8  # concurrent on the shared socket(s), not serialised


@pytest.mark.parametrize("fake_server", [{"mode": "500"}], indirect=True)
def test_ws_error_messages_fail_their_requests(fake_server, tmp_path):
    rc, doc = _run(fake_server.url, tmp_path, "--backend", "ws", "--num-prompts", "3")
    assert rc == 2
    assert all(r["error"] == "websocket error: engine failed" for r in doc["requests"])


def test_duration_bounds_the_run(fake_server, tmp_path):
    rc, doc = _run(
        fake_server.url, tmp_path, "--duration", "0.5", "--request-rate", "40", "--max-concurrency", "8"
    )
    assert rc == 0
    assert 3 <= doc["metrics"]["completed"] <= 60
    # nothing arrives after 0.5 s, even when the concurrency limit holds an arrival back; a request's
    # start_s is taken as it is sent, an event-loop turn after its arrival (0.5008 s once on CI)
    assert max(r["start_s"] for r in doc["requests"]) < 0.5 + 0.05


def test_random_ids_dataset_sends_token_ids(fake_server, tmp_path):
    rc, doc = _run(fake_server.url, tmp_path, "--backend", "completions", "--dataset-name", "random-ids",
                   "--num-prompts", "3")  # fmt: skip
    assert rc == 0
    assert [r["prompt_tokens"] for r in doc["requests"]] == [r["input_len"] for r in doc["requests"]]


def test_shared_prefix_and_jsonl_datasets(fake_server, tmp_path):
    rc, doc = _run(fake_server.url, tmp_path, "--dataset-name", "shared-prefix", "--gsp-num-groups", "2",
                   "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "20", "--gsp-question-len", "4",
                   "--gsp-output-len", "3")  # fmt: skip
    assert rc == 0 and doc["metrics"]["completed"] == 6
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 2}\n{"prompt": "a b c"}\n')
    rc, doc = _run(fake_server.url, tmp_path, "--dataset-name", "jsonl", "--dataset-path", str(path))
    assert rc == 0 and [r["output_len_requested"] for r in doc["requests"]] == [2, 8]


def test_plot_writes_a_png(fake_server, tmp_path):
    png = tmp_path / "out.png"
    rc, _ = _run(
        fake_server.url, tmp_path, "--num-prompts", "10", "--request-rate", "200", "--plot", str(png)
    )
    assert rc == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_compare_prints_ratios(fake_server, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["serve", "--base-url", fake_server.url, *QUICK, "--num-prompts", "4"]
    assert main([*base, "--out", str(a)]) == 0
    assert main([*base, "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "Successful requests" in out and "1.000" in out and "Mean TTFT (ms)" in out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loadgen", *args], capture_output=True, text=True, timeout=60
    )


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_closed_port_gives_one_clean_line():
    p = _cli("serve", "--port", str(_closed_port()), *QUICK, "--num-prompts", "2")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: cannot connect to")
    assert "connection refused" in p.stderr


@pytest.mark.parametrize("fake_server", [{"mode": "500"}], indirect=True)
def test_server_answering_500_is_reported_as_failed_requests(fake_server, tmp_path):
    p = _cli(
        "serve",
        "--base-url",
        fake_server.url,
        *QUICK,
        "--num-prompts",
        "3",
        "--out",
        str(tmp_path / "r.json"),
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "error: all 3 requests failed: 3 x HTTP 500: engine failed" in p.stderr
    assert "Failed requests:" in p.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["metrics"]["failed"] == 3
    assert all(r["status"] == 500 and r["error"] == "HTTP 500: engine failed" for r in doc["requests"])


@pytest.mark.parametrize("fake_server", [{"mode": "badjson"}], indirect=True)
def test_bad_json_in_the_stream_fails_the_request_cleanly(fake_server):
    p = _cli("serve", "--base-url", fake_server.url, *QUICK, "--num-prompts", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "bad JSON in stream" in p.stderr


def test_bad_arguments_are_one_line_errors(tmp_path):
    p = _cli("serve", "--base-url", "ftp://x", "--num-prompts", "1")
    assert p.returncode == 2 and p.stderr.startswith("error: --base-url") and "Traceback" not in p.stderr
    p = _cli("compare", str(tmp_path / "missing.json"), str(tmp_path / "missing.json"))
    assert p.returncode == 2 and p.stderr.startswith("error: cannot read")


def test_compare_header_names_the_whole_files(tmp_path, capsys):
    from loadgen.metrics import Metrics
    from loadgen.report import compare

    doc = {"metrics": Metrics(1, 0, 1.0, 1, 1, 1.0, 1.0, 1.0, 2.0, 1.0).to_json()}
    out = compare(doc, doc, "/tmp/runs/baseline-with-long-name.json", "/tmp/runs/candidate.json")
    header = out.splitlines()[0]
    assert "baseline-with-long-name.json" in header and "candidate.json" in header
    same = compare(doc, doc, "/a/x/r.json", "/a/y/r.json").splitlines()[0]
    assert "x/r.json" in same and "y/r.json" in same


def test_results_json_is_strict_json_without_infinity(tmp_path):
    from loadgen.report import write_json

    path = tmp_path / "r.json"
    write_json(str(path), {"config": {"request_rate": float("inf")}, "metrics": {"x": [float("nan"), 1.5]}})
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text) == {"config": {"request_rate": None}, "metrics": {"x": [None, 1.5]}}

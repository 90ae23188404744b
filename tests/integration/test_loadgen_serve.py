"""loadgen against the real `conduit serve` on the CPU: every metric, counts that match the server's,
and a concurrency limit that holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

N = 12
OUT_LEN = 8


def run_loadgen(server, tmp_path, *args: str) -> dict:
    out = tmp_path / "run.json"
    cmd = [
        sys.executable,
        "-m",
        "loadgen",
        "serve",
        "--base-url",
        server.url,
        "--num-prompts",
        str(N),
        "--random-input-len",
        "48",
        "--random-output-len",
        str(OUT_LEN),
        "--random-range-ratio",
        "0.5",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return json.loads(out.read_text())


def max_overlap(requests: list[dict]) -> int:
    events = sorted(
        [(r["start_s"], 1) for r in requests] + [(r["end_s"], -1) for r in requests],
        key=lambda e: (e[0], e[1]),
    )
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("backend", ["completions", "chat", "ws"])
def test_loadgen_reports_every_metric_and_matches_the_server(server, smollm2_path, tmp_path, backend):
    before = server.metrics()
    result = run_loadgen(
        server, tmp_path, "--backend", backend, "--max-concurrency", "4", "--tokenizer", str(smollm2_path)
    )
    after = server.metrics()
    m = result["metrics"]
    for key in (
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "total_throughput",
        "concurrency",
    ):
        assert key in m, key
    for lat in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(m[lat]) == {"mean", "median", "p90", "p99", "max"}, m[lat]
        assert 0 < m[lat]["median"] <= m[lat]["max"]
    assert m["completed"] == N and m["failed"] == 0
    reqs = result["requests"]
    assert all(r["ttft_s"] <= r["e2e_s"] for r in reqs)
    # ignore_eos: every request runs to the length it asked for
    assert all(r["completion_tokens"] == r["output_len_requested"] for r in reqs)
    served = after["conduit_generation_tokens_total"] - before["conduit_generation_tokens_total"]
    assert served == sum(r["completion_tokens"] for r in reqs) == m["total_output_tokens"]
    prompt = after["conduit_prompt_tokens_total"] - before["conduit_prompt_tokens_total"]
    assert prompt == sum(r["prompt_tokens"] for r in reqs)
    assert max_overlap(reqs) <= 4
    assert result["server_models"]["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_loadgen_against_a_closed_port_reports_cleanly(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadgen",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            "2",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "refused" in (proc.stdout + proc.stderr).lower()

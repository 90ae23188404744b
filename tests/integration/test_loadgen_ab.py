"""`loadgen ab` against two real `conduit serve` configurations on the CPU, one started after the other:
per-run results and logs, each variant's own environment, and the side-by-side table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_ab_runs_each_variant_on_its_own_server_and_prints_them_side_by_side(smollm2_path, tmp_path):
    out = tmp_path / "ab"
    cmd = [sys.executable, "-m", "loadgen", "ab", "--out-dir", str(out),
           "--variant", "small", "--max-running-requests 2",
           "--variant", "large", "--max-running-requests 4",
           "--variant-env", "large", "CONDUIT_LOG_FORMAT=json",
           "--backend", "completions", "--num-prompts", "4", "--random-input-len", "16",
           "--random-output-len", "4", "--warmup-requests", "0", "--disable-tqdm"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "large vs small, round 1" in proc.stdout and "Output token throughput" in proc.stdout
    summary = proc.stdout[proc.stdout.index("output tok/s") :].splitlines()
    assert [ln.split()[0] for ln in summary[1:3]] == ["small", "large"] and summary[1].endswith("1.000")
    for name in ("small", "large"):
        result = json.loads((out / f"{name}-r1.json").read_text())
        assert result["metrics"]["completed"] == 4 and result["metrics"]["failed"] == 0

    # the environment reached only its variant's server: JSON log lines there, console lines in the other
    def json_lines(name: str) -> list[str]:
        return [ln for ln in (out / f"{name}-r1.server.log").read_text().splitlines() if ln.startswith("{")]

    assert json_lines("large") and not json_lines("small")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--variant", "a", "--x 1"], "names must differ"),
        (["--variant-env", "zzz", "K=V"], "needs a --variant name"),
        (["--variant-env", "a", "novalue"], "KEY=VALUE"),
        (["--server-cmd", "serve --port 1"], "must contain {port}"),
        (["--rounds", "0"], "--rounds must be >= 1"),
    ],
)
def test_ab_rejects_bad_variants_before_starting_anything(tmp_path, extra, message):
    cmd = [
        sys.executable,
        "-m",
        "loadgen",
        "ab",
        "--out-dir",
        str(tmp_path),
        "--variant",
        "a",
        "--y 2",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())  # no server was started, no run written

"""`loadgen.gpu_clock`: nvidia-smi's CSV samples -> the clock and power under load, in every results file.

No GPU here: the parser is fed nvidia-smi's documented `--format=csv,noheader,nounits` lines, and the
sampler's process handling runs against a stand-in `nvidia-smi` on PATH that prints such lines in a loop
until interrupted, as the real one does with --loop-ms."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import pytest

from loadgen import gpu_clock
from loadgen.cli import main

LINES = [
    "0, 1980, 120.50",  # idle before the load starts: below half the peak power, left out
    "0, 1665, 671.20",
    "1, 1755, 655.00",
    "0, 1590, 690.00",
    "0, 1620, [N/A]",  # a field the driver could not read
    "garbage",
]


def test_parse_and_summarize_keep_loaded_samples_per_gpu():
    samples = gpu_clock.parse(LINES)
    assert samples == {0: [(1980.0, 120.5), (1665.0, 671.2), (1590.0, 690.0)], 1: [(1755.0, 655.0)]}
    s = gpu_clock.summarize(samples)
    g0 = s["0"]
    assert g0["samples"] == 3 and g0["loaded_samples"] == 2
    assert g0["sm_clock_mhz"] == {"mean": 1627.5, "min": 1590.0, "max": 1665.0}
    assert g0["power_w"]["max"] == 690.0
    assert s["1"]["sm_clock_mhz"]["mean"] == 1755.0
    assert gpu_clock.describe(s) == "1628 MHz (1590-1665), 681 W"
    assert gpu_clock.summarize({}) is None and gpu_clock.describe(None) is None


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH: one CSV line per GPU every 20 ms until SIGINT, like --loop-ms."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        trap 'exit 0' INT
        while true; do echo "0, 1650, 660.0"; echo "1, 1700, 640.0"; sleep 0.02; done
    """)
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return exe


def test_sampler_collects_until_the_block_ends(fake_smi):
    import time

    with gpu_clock.GpuSampler(interval_ms=20) as s:
        time.sleep(0.3)
    assert s.proc.returncode is not None  # stopped, not left running
    assert set(s.summary) == {"0", "1"} and s.summary["0"]["samples"] >= 3
    assert s.summary["1"]["sm_clock_mhz"]["mean"] == 1700.0


def test_sampler_without_nvidia_smi_gives_none(monkeypatch):
    with gpu_clock.GpuSampler(command="no-such-nvidia-smi") as s:
        pass
    assert s.proc is None and s.summary is None


def test_only_a_server_on_this_machine_is_sampled(fake_smi):
    assert gpu_clock.is_local("http://127.0.0.1:30000") and gpu_clock.is_local("http://localhost:8000/")
    assert gpu_clock.is_local("http://[::1]:8000") and gpu_clock.is_local("http://127.0.0.2:8000")
    assert not gpu_clock.is_local("http://10.0.0.5:30000")
    assert not gpu_clock.is_local("https://api.example.com")
    with gpu_clock.GpuSampler(enabled=False) as s:  # a remote server: this machine's GPUs say nothing
        pass
    assert s.proc is None and s.summary is None


# 20 chunks 25 ms apart: the benchmark lasts about half a second, time for the stand-in to print
@pytest.mark.parametrize("fake_server", [{"chunk_delay": 0.025}], indirect=True)
def test_serve_writes_the_clock_into_the_results(fake_server, fake_smi, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["serve", "--base-url", fake_server.url, "--dataset-name", "random", "--random-input-len", "8",
               "--random-output-len", "20", "--num-prompts", "4", "--disable-tqdm", "--warmup-requests", "0",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["gpu"]["0"]["sm_clock_mhz"]["mean"] == 1650.0
    assert "GPU clock, power:" in capsys.readouterr().out

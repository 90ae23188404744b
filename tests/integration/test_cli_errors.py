"""Mistakes a new user makes get one clear line and an exit code, not a traceback: a second `conduit
serve` on a port that is taken fails at once, before loading the engine; `conduit convert` of a file that
does not exist says so."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from loadgen.launch import conduit_serve


def test_a_busy_port_fails_at_once_with_one_line(smollm2_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        p = subprocess.run(conduit_serve(port), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    assert p.returncode == 2
    assert p.stderr.strip() == f"conduit: cannot listen on 127.0.0.1:{port}: the address is already in use"
    assert "engine_ready" not in p.stdout + p.stderr and elapsed < 30  # the engine was never started


def test_convert_of_a_missing_file_is_one_line(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "convert", "/nonexistent.gguf", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == "conduit convert: GGUF file not found: /nonexistent.gguf"
    assert "Traceback" not in p.stdout + p.stderr

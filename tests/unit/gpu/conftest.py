"""`smollm2_path` comes from tests/conftest.py (converted once per machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The transformers implementation on the converted weights: the parity oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32", local_files_only=True)
    return model.eval()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Undo the root conftest's CUDA skip for CPU tests that merely live in a folder named `gpu`.

    tests/conftest.py tests `"gpu" in item.keywords`, which also matches the directory name; only a real
    `gpu` marker (`item.get_closest_marker("gpu")`) should skip. Remove this once that check is fixed."""
    for item in items:
        if "tests/unit/gpu/" in item.nodeid.replace("\\", "/") and item.get_closest_marker("gpu") is None:
            item.own_markers[:] = [
                m
                for m in item.own_markers
                if not (m.name == "skip" and "CUDA" in str(m.kwargs.get("reason", "")))
            ]

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded SmolLM2-135M, converted from GGUF once (cached on disk across sessions too)."""
    from runtime.gpu.convert import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The transformers implementation on the converted weights: the parity oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32", local_files_only=True)
    return model.eval()

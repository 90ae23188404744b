"""`smollm2_path` comes from tests/conftest.py (converted once per machine)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The transformers implementation on the converted weights: the parity oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32", local_files_only=True)
    return model.eval()

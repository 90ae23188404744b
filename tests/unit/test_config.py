"""ServerConfig defaults that depend on the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime.config import ServerConfig


def test_an_explicit_chunked_prefill_size_is_kept() -> None:
    assert ServerConfig(chunked_prefill_size=96).resolved_chunked_prefill_size() == 96
    assert ServerConfig(device="cuda", chunked_prefill_size=96).resolved_chunked_prefill_size() == 96


def test_the_cpu_default_chunked_prefill_size() -> None:
    assert ServerConfig().resolved_chunked_prefill_size() == 2048


@pytest.mark.parametrize(("gib", "tokens"), [(24, 2048), (80, 8192), (141, 8192), (180, 16384)])
def test_the_cuda_default_follows_the_gpus_memory_as_sglang(monkeypatch, gib, tokens) -> None:
    """SGLang's tiers: under 35 GB 2048, under 160 GB (H100, H200) 8192, above 16384."""
    props = SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert ServerConfig(device="cuda").resolved_chunked_prefill_size() == tokens

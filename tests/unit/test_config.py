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


def gpu(monkeypatch, gib: float) -> None:
    props = SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


@pytest.mark.parametrize(("gib", "tokens"), [(24, 2048), (80, 8192), (141, 16384), (180, 16384)])
def test_the_cuda_step_budget_follows_the_gpus_memory(monkeypatch, gib, tokens) -> None:
    """Under 35 GB 2048, under 120 GB (H100) 8192, above (H200) 16384."""
    gpu(monkeypatch, gib)
    assert ServerConfig(device="cuda").resolved_chunked_prefill_size() == tokens


@pytest.mark.parametrize(("gib", "rows", "fraction"), [(24, 128, 0.8), (80, 256, 0.88), (141, 256, 0.9)])
def test_running_requests_and_memory_fraction_follow_the_gpus_memory(
    monkeypatch, gib, rows, fraction
) -> None:
    gpu(monkeypatch, gib)
    cfg = ServerConfig(device="cuda")
    assert cfg.resolved_max_running_requests() == rows
    assert cfg.resolved_mem_fraction_static() == fraction
    assert cfg.kv_slot_cap() is None  # the runner sizes the pool from what memory is left
    assert ServerConfig(device="cuda", max_total_tokens=1000).kv_slot_cap() == 1000  # a cap
    assert ServerConfig(device="cuda", mem_fraction_static=0.5).resolved_mem_fraction_static() == 0.5


def test_cpu_defaults_are_fixed() -> None:
    cfg = ServerConfig()
    assert (cfg.resolved_max_running_requests(), cfg.kv_slot_cap()) == (128, 32768)

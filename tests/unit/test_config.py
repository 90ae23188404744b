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


@pytest.mark.parametrize(("flag", "ratio"), [(None, 0.7), ("0.1", 0.07), ("3", 1.0)])
def test_schedule_conservativeness_scales_what_admission_reserves(flag, ratio) -> None:
    """SGLang's meaning: the first reserved share of each request's remaining max_tokens is 0.7 times
    the flag, at most all of it."""
    from runtime.cli import build_parser, config_from_args
    from runtime.config import SchedulerConfig
    from runtime.mailbox.messages import WorkerCapabilities

    argv = ["serve"] + (["--schedule-conservativeness", flag] if flag else [])
    cfg = config_from_args(build_parser().parse_args(argv))
    caps = WorkerCapabilities(
        rank=0, model="m", num_kv_slots=1000, page_size=1, max_reqs=8, max_model_len=512,
        prefix_cache=True, prefix_replay=0, kv_bytes_per_token=1, vocab_size=10,
    )  # fmt: skip
    assert SchedulerConfig.resolve(cfg, caps).init_new_token_ratio == pytest.approx(ratio)


def test_schedule_conservativeness_must_be_positive(capsys) -> None:
    from runtime.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--schedule-conservativeness", "0"])
    assert "must be above 0" in capsys.readouterr().err

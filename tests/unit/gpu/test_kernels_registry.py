"""The op registry picks the first available implementation per device, honours CONDUIT_KERNEL_<OP>,
and refuses unknown or unavailable forced choices."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu import kernels
from runtime.gpu.kernels import registry

LLAMA_OPS = ["decode_attention", "extend_attention", "rms_norm", "rope", "silu_and_mul"]


def test_every_llama_op_has_a_triton_impl_first_and_the_reference_last() -> None:
    assert set(LLAMA_OPS) <= set(kernels.ops())
    for op in LLAMA_OPS:
        names = [i.name for i in kernels.implementations(op)]
        assert names[0] == "triton" and names[-1] == "reference", (op, names)


def test_cpu_uses_the_references() -> None:
    assert kernels.describe("cpu") == dict.fromkeys(kernels.ops(), "reference")


def test_cuda_prefers_triton_when_it_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(registry, "has_module", lambda name: name == "triton")
    registry.clear_cache()
    try:
        assert registry.select("decode_attention", "cuda").name == "triton"
    finally:
        registry.clear_cache()


def test_forcing_an_implementation_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "reference")
    registry.clear_cache()
    assert registry.select("rms_norm", "cuda").name == "reference"
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "triton")
    registry.clear_cache()
    with pytest.raises(RuntimeError, match="not available"):
        registry.select("rms_norm", "cpu")
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "nope")
    registry.clear_cache()
    with pytest.raises(ValueError, match="choose from"):
        registry.select("rms_norm", "cpu")
    monkeypatch.delenv("CONDUIT_KERNEL_RMS_NORM")
    registry.clear_cache()
    assert registry.select("rms_norm", "cpu").name == "reference"


def test_get_returns_the_callable_of_the_chosen_implementation() -> None:
    x = torch.randn(3, 8)
    fn = kernels.get("rms_norm", "cpu")
    torch.testing.assert_close(
        fn(x, torch.ones(8), 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    )


def test_an_op_registered_twice_under_one_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        registry.register("rms_norm", "reference", "x:y", registry.always)


def test_named_finds_an_implementation_available_or_not() -> None:
    assert registry.named("mla_decode", "flash_mla").name == "flash_mla"  # not importable here
    assert registry.named("mla_decode", "reference").load() is registry.get("mla_decode", "cpu")
    with pytest.raises(KeyError, match="no implementation 'nope'"):
        registry.named("mla_decode", "nope")

"""The op registry picks the first available implementation per device, honours CONDUIT_KERNEL_<OP>,
refuses unknown or unavailable forced choices, and every implementation takes its op's contract."""

from __future__ import annotations

import inspect

import pytest
import torch

from runtime.gpu import kernels
from runtime.gpu.kernels import registry
from runtime.gpu.kernels.decode_attention import DECODE_ATTENTION
from runtime.gpu.kernels.mla_decode import MLA_DECODE
from runtime.gpu.kernels.rms_norm import RMS_NORM, RmsNorm

LLAMA_OPS = ["decode_attention", "extend_attention", "rms_norm", "rope", "silu_and_mul"]


def test_every_llama_op_has_a_triton_impl_first_and_the_reference_last() -> None:
    """...except decode attention, whose TileLang entry (fp8 pools on Hopper) comes before Triton."""
    assert set(LLAMA_OPS) <= set(kernels.ops())
    for op in LLAMA_OPS:
        names = [i.name for i in kernels.op(op).implementations()]
        first = ["tilelang", "triton"] if op == "decode_attention" else ["triton"]
        assert names[: len(first)] == first and names[-1] == "reference", (op, names)


def test_the_tilelang_decode_entry_hands_what_it_does_not_cover_to_triton(monkeypatch) -> None:
    """A 16-bit pool (or float32 queries) is not the TileLang kernel's: the Triton kernel runs whole."""
    from runtime.gpu.kernels.decode_attention import tilelang, triton

    calls = []
    monkeypatch.setattr(triton, "decode_attention", lambda *a, **k: calls.append(a[1].dtype) or "triton")
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
    for pool_dtype in (torch.bfloat16, torch.float16):
        pool = torch.zeros(4, 8, 128, dtype=pool_dtype)
        assert not tilelang.supported(q, pool)
        assert tilelang.decode_attention(q, pool, pool, None, None, None, 0.1) == "triton"
    fp8 = torch.zeros(4, 8, 128, dtype=torch.float8_e4m3fn)
    assert tilelang.supported(q, fp8) and not tilelang.supported(q.float(), fp8)
    assert not tilelang.supported(torch.zeros(2, 64, 128, dtype=torch.bfloat16), fp8[:, :2])  # group 32
    assert calls == [torch.bfloat16, torch.float16]


def test_cpu_uses_the_references() -> None:
    assert kernels.describe("cpu") == dict.fromkeys(kernels.ops(), "reference")


def test_cuda_prefers_triton_when_it_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(registry, "has_module", lambda name: name == "triton")
    registry.clear_cache()
    try:
        assert DECODE_ATTENTION.select("cuda").name == "triton"
    finally:
        registry.clear_cache()


def test_forcing_an_implementation_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "reference")
    registry.clear_cache()
    assert RMS_NORM.select("cuda").name == "reference"
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "triton")
    registry.clear_cache()
    with pytest.raises(RuntimeError, match="not available"):
        RMS_NORM.select("cpu")
    monkeypatch.setenv("CONDUIT_KERNEL_RMS_NORM", "nope")
    registry.clear_cache()
    with pytest.raises(ValueError, match="choose from"):
        RMS_NORM.get("cpu")
    monkeypatch.delenv("CONDUIT_KERNEL_RMS_NORM")
    registry.clear_cache()
    assert RMS_NORM.select("cpu").name == "reference"


def test_get_returns_the_callable_of_the_chosen_implementation() -> None:
    x = torch.randn(3, 8)
    fn = RMS_NORM.get("cpu")
    assert fn is RMS_NORM.get(torch.device("cpu")) is RMS_NORM.select("cpu").load()
    torch.testing.assert_close(
        fn(x, torch.ones(8), 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    )


def test_an_op_is_found_by_name_with_its_contract() -> None:
    assert kernels.op("rms_norm") is RMS_NORM and RMS_NORM.contract is RmsNorm
    with pytest.raises(KeyError, match="unknown kernel op"):
        kernels.op("nope")


def test_an_op_or_an_implementation_declared_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        RMS_NORM.register("reference", "x:y", registry.always)
    with pytest.raises(ValueError, match="twice"):
        registry.Op("rms_norm", RmsNorm)


def test_named_finds_an_implementation_available_or_not() -> None:
    assert MLA_DECODE.named("flash_mla").name == "flash_mla"  # not importable here
    assert MLA_DECODE.named("reference").load() is MLA_DECODE.get("cpu")
    with pytest.raises(KeyError, match="no implementation 'nope'"):
        MLA_DECODE.named("nope")


@pytest.mark.parametrize("name", kernels.ops())
def test_every_implementation_takes_its_ops_contract(name: str) -> None:
    """Each implementation's parameters begin with the contract's (same names, kinds and defaults, in
    order); any it adds after them have defaults, so every call the Protocol allows is one it takes."""
    op = kernels.op(name)
    want = list(inspect.signature(op.contract.__call__).parameters.values())[1:]  # without self
    for impl in op.implementations():
        got = list(inspect.signature(impl.load()).parameters.values())
        head = [(p.name, p.kind, p.default) for p in got[: len(want)]]
        assert head == [(p.name, p.kind, p.default) for p in want], (name, impl.name)
        assert all(p.default is not p.empty for p in got[len(want) :]), (name, impl.name)


def _prepared_meta(backend, prefix: list[int], ext: list[int]):
    """TritonAttentionBackend.prepare's metadata for a CPU step of rows 10.. with these columns."""
    import torch

    from runtime.gpu.forward_batch import ForwardBatch

    n, t = len(ext), sum(ext)
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64), positions=torch.zeros(t, dtype=torch.int64),
        out_loc=torch.zeros(t, dtype=torch.int64), rows=torch.arange(n), rows_list=list(range(10, 10 + n)),
        prefix_lens=prefix, extend_lens=ext, req_to_token=torch.zeros(10 + n, 64, dtype=torch.int64),
        kv_pool=None,
    )  # fmt: skip
    backend.prepare(batch)
    return batch.attn_meta


def test_a_mixed_steps_leading_decode_rows_take_the_decode_kernel() -> None:
    """TritonAttentionBackend.prepare: the leading single-token rows of a mixed step are its decode rows
    (the rest run the prefill kernel)."""
    from runtime.gpu.attention.triton_backend import TritonAttentionBackend

    def num_decode(backend: TritonAttentionBackend, ext: list[int]) -> tuple[bool, int]:
        meta = _prepared_meta(backend, [5] * len(ext), ext)
        return meta.decode, meta.num_decode

    backend = TritonAttentionBackend(4, 2, 16, 0.25)
    assert num_decode(backend, [1, 1, 7, 1]) == (False, 2)
    assert num_decode(backend, [9, 1]) == (False, 0)
    assert num_decode(backend, [1, 1, 1]) == (True, 3)


def test_prefill_rows_take_the_prefill_kernel_with_their_own_columns() -> None:
    """TritonAttentionBackend.prepare: a mixed step's non-decode rows get their own columns (each starting
    16-byte aligned), their longest new part and whether any has a cached prefix; the backend sends them
    to the prefill kernel, or to the extend kernel at head dims that are not powers of two."""
    from runtime.gpu.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(4, 2, 16, 0.25)
    assert backend.prefill_kernel
    m = _prepared_meta(backend, [5, 5, 0, 3, 0], [1, 1, 9, 4, 6])
    assert m.num_decode == 2
    rows, prefix, ext, starts, longest, any_prefix = m.prefill
    assert (rows.tolist(), prefix.tolist(), ext.tolist(), starts.tolist()) == (
        [12, 13, 14],
        [0, 3, 0],
        [9, 4, 6],
        [2, 11, 15],
    )
    assert (longest, any_prefix) == (9, True)
    assert all(t.data_ptr() % 16 == 0 for t in m.prefill[:4])
    assert _prepared_meta(backend, [5, 0, 0], [1, 7, 2]).prefill[4:] == (7, False)
    assert _prepared_meta(backend, [5, 5], [1, 1]).prefill is None  # all decode
    assert not TritonAttentionBackend(4, 2, 24, 0.25).prefill_kernel  # head dim not a power of two

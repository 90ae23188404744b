"""Sparse attention over selected rows (op `sparse_attention`, DeepSeek-V4): every implementation the
registry lists matches the PyTorch reference on CUDA at V4-Flash shapes (H 64, d 512, 128 window rows +
512 top-k entries per token, T 1 / 64 / 4096), with early tokens whose lists are mostly -1, ragged
`topk_length`, two sources, no sink, bf16 / fp16 / fp32 and small test shapes; under a CUDA graph; and
the V4 backend's `attend_selected` equals `attend_with_sink`. Rows no index names, and the row before
each pool (index -1), hold NaN. `pytest -s` prints each case's error ratio (<= 1 passes) and time."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.gpu.kernels.sparse_attention.testing import sparse_case
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio, impl_names, load_impl, load_reference

pytestmark = pytest.mark.gpu

OP = "sparse_attention"
H, D, WINDOW, TOPK = 64, 512, 128, 512  # V4-Flash


def _check(label: str, fn, c, dtype: torch.dtype, sinks: bool = True) -> None:
    args = (c.q, c.kv, c.indices, c.sinks if sinks else None, c.scale)
    want = load_reference(OP)(*args, **c.kwargs())
    fn(*args, **c.kwargs())  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = fn(*args, **c.kwargs())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    ratio = close_ratio(got, want, *TOLERANCE[dtype])
    print(f"\n  {label}: error {ratio:.3f}x tol, {ms:.3f} ms (incl. launch), {c.selected} rows gathered")
    assert ratio <= 1.0


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_v4_flash_shapes_match_reference(name: str, tokens: int) -> None:
    """Tokens after an 8K prefix: full windows, 512 distinct visible entries each."""
    c = sparse_case(tokens, H, D, WINDOW, TOPK, torch.bfloat16, "cuda", prefix=8192, seed=tokens)
    _check(f"{name} T={tokens}", load_impl(OP, name), c, torch.bfloat16)


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("two_sources", [False, True], ids=["one_pool", "two_sources"])
def test_early_tokens_ragged_lengths_and_two_sources(name: str, two_sources: bool) -> None:
    """Positions 0..299: windows cut at 0 and fewer than 512 visible entries (-1 padding), and a random
    topk_length per token whose tail points at NaN rows."""
    c = sparse_case(300, H, D, WINDOW, TOPK, torch.bfloat16, "cuda", two_sources=two_sources, ragged=True)
    c.indices[7] = -1  # a token with no row of the first source
    _check(f"{name} ragged two_sources={two_sources}", load_impl(OP, name), c, torch.bfloat16)


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes(name: str, dtype: torch.dtype) -> None:
    c = sparse_case(64, H, D, WINDOW, TOPK, dtype, "cuda", prefix=3000, seed=1)
    _check(f"{name} {dtype}", load_impl(OP, name), c, dtype)


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("shape", [(4, 32, 3, 4), (20, 64, 16, 48), (128, 512, 1, 7)], ids=str)
def test_small_shapes_without_sink(name: str, shape: tuple) -> None:
    """Heads 4 / 20 / 128 (not a multiple of the head block), d 32 / 64, K 7..64; no sink."""
    heads, dim, window, topk = shape
    c = sparse_case(37, heads, dim, window, topk, torch.bfloat16, "cuda", prefix=50, seed=heads)
    _check(f"{name} H={heads} d={dim} K={window + topk}", load_impl(OP, name), c, torch.bfloat16, sinks=False)


def test_triton_under_cuda_graph() -> None:
    c = sparse_case(64, H, D, WINDOW, TOPK, torch.bfloat16, "cuda", prefix=1000, ragged=True, seed=2)
    fn = load_impl(OP, "triton")
    out = torch.empty_like(c.q)
    fn(*c.args(), **c.kwargs(), out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*c.args(), **c.kwargs(), out=out)
    c.q.copy_(torch.randn_like(c.q))
    c.topk_length.copy_(torch.minimum(c.topk_length, torch.randint_like(c.topk_length, 0, 200)))  # not past
    g.replay()
    want = load_reference(OP)(*c.args(), **c.kwargs())
    assert close_ratio(out, want, *TOLERANCE[torch.bfloat16]) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_v4_backend_attend_selected_equals_attend_with_sink(dtype: torch.dtype) -> None:
    """What TorchV4Backend runs on CUDA (the registry's op on each request's keys and mask) against the
    PyTorch attention it replaces: a 40-token chunk, 7 ring rows + 40 new + 30 entries, top-8 of them."""
    from runtime.gpu.models.deepseek_v4.attention import attend_selected, attend_with_sink

    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(40, 8, 64, generator=g, device="cuda").to(dtype)
    keys = torch.randn(77, 64, generator=g, device="cuda").to(dtype)
    pos = torch.arange(47, device="cuda")
    window = (pos[None, :] <= pos[7:, None]) & (pos[None, :] > pos[7:, None] - 8)
    entries = torch.rand(40, 30, generator=g, device="cuda").argsort(1) < 8
    mask = torch.cat([window, entries], 1)
    sinks = torch.randn(8, generator=g, device="cuda")
    got = attend_selected(q, keys, mask, sinks, 0.125)
    want = attend_with_sink(q.float(), keys.float(), mask, sinks, 0.125)
    assert close_ratio(got, want, *TOLERANCE[dtype]) <= 1.0

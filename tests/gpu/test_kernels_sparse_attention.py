"""Sparse attention over selected rows (op `sparse_attention`, DeepSeek-V4): every implementation the
registry lists matches the PyTorch reference on CUDA at V4-Flash shapes (H 64, d 512, 128 window rows +
512 top-k entries per token, T 1 / 64 / 4096), with early tokens whose lists are mostly -1, ragged
`topk_length`, two sources, no sink, bf16 / fp16 / fp32 and small test shapes; under a CUDA graph; and
V4 prefill's HCA call, one entry list shared by a tile of queries and cut per query. Rows no index names, and the row before
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


@pytest.mark.parametrize("name", impl_names(OP))
def test_hca_prefill_tile_with_one_shared_entry_list(name: str) -> None:
    """V4's HCA prefill call (TorchV4Backend._attend_row): a 4096-query tile after 60K tokens, its window
    rows as the first source and the 512 HCA entries the tile sees as one list shared by every query
    (stride 0), cut per query by extra_topk_length to the entries it sees."""
    prefix, tokens, rate = 61440, 4096, 128
    c = sparse_case(
        tokens, H, D, WINDOW, 1, torch.bfloat16, "cuda", prefix=prefix, rate=rate, two_sources=True
    )
    entries = (prefix + tokens) // rate
    shared = torch.arange(entries, dtype=torch.int32, device="cuda").expand(tokens, -1)
    seen = ((torch.arange(prefix, prefix + tokens, device="cuda") + 1) // rate).int()
    kw = dict(extra_kv=c.extra_kv, extra_indices=shared, extra_topk_length=seen)
    args = (c.q, c.kv, c.indices, c.sinks, c.scale)
    got = load_impl(OP, name)(*args, **kw)
    assert close_ratio(got, load_reference(OP)(*args, **kw), *TOLERANCE[torch.bfloat16]) <= 1.0

"""Every paged-attention implementation the registry knows matches the PyTorch reference on CUDA:
batches 1..64, contexts 1..4096 (block-size non-multiples included), GQA 1/4/8, head_dim 64 and 128,
shuffled slots at several page sizes, mixed extend + decode batches, and the backend on real steps."""

from __future__ import annotations

import functools

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.testing import (
    TOLERANCE,
    backend_outputs,
    close_ratio,
    impl_names,
    load_impl,
    load_reference,
    paged_case,
)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _lens(batch: int, max_ctx: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g).tolist()
    lens[0] = max_ctx  # the longest context is always present
    return lens


DECODE_SHAPES = [  # batch, max context, q heads, kv heads, head_dim, page size
    (1, 1, 32, 8, 128, 1),
    (1, 4096, 32, 8, 128, 1),
    (3, 1000, 32, 32, 128, 16),
    (8, 1023, 32, 4, 64, 1),
    (16, 777, 8, 1, 128, 64),
    (32, 129, 9, 3, 64, 1),
    (64, 2049, 32, 8, 128, 16),
    (64, 4096, 16, 2, 64, 1),
]


@pytest.mark.parametrize("name", impl_names("decode_attention"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "b{}-ctx{}-h{}/{}-d{}-page{}".format(*s))
def test_decode_attention_matches_reference(name: str, dtype: torch.dtype, shape: tuple) -> None:
    batch, ctx, hq, hkv, d, page = shape
    lens = _lens(batch, ctx, seed=batch + ctx)
    c = paged_case([n - 1 for n in lens], [1] * batch, hq, hkv, d, dtype, "cuda", page_size=page)
    want = load_reference("decode_attention")(*c.decode_args())
    got = load_impl("decode_attention", name)(*c.decode_args())
    assert close_ratio(got, want, *TOLERANCE[dtype]) <= 1.0


@pytest.mark.parametrize("q_len", [2, 4, 8])
@pytest.mark.parametrize(
    "shape", [(8, 4096, 32, 8, 128), (64, 1000, 32, 8, 128), (5, 300, 9, 3, 64)], ids=str
)
def test_decode_attention_with_several_query_tokens_matches_extend_reference(
    q_len: int, shape: tuple
) -> None:
    """Verify steps: q_len tokens per row, each causal over the row's prefix and the new tokens before it."""
    batch, ctx, hq, hkv, d = shape
    lens = _lens(batch, ctx, seed=batch + q_len)
    c = paged_case([max(n - q_len, 0) for n in lens], [q_len] * batch, hq, hkv, d, torch.bfloat16, "cuda")
    want = load_reference("extend_attention")(*c.extend_args())
    for name in impl_names("decode_attention"):
        got = load_impl("decode_attention", name)(*c.decode_args(), q_len=q_len)
        assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0, name
    got = load_impl("decode_attention", "triton")(*c.decode_args(), num_splits=16, q_len=q_len)
    assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_attention_any_split_count_gives_the_same_answer(num_splits: int) -> None:
    c = paged_case([0, 63, 64, 65, 3000], [1] * 5, 32, 8, 128, torch.bfloat16, "cuda")
    want = load_reference("decode_attention")(*c.decode_args())
    got = load_impl("decode_attention", "triton")(*c.decode_args(), num_splits=num_splits)
    assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0


@pytest.mark.parametrize(
    ("op", "name"), [(op, name) for op in ("decode_attention", "extend_attention") for name in impl_names(op)]
)
def test_attention_reads_an_fp8_kv_pool_under_bf16_queries(op: str, name: str) -> None:
    """--kv-cache-dtype fp8_e4m3: the kernels upcast the pool as they load it; the reference does the same."""
    prefix, ext = ([0, 63, 1000, 4000], [1] * 4) if op == "decode_attention" else ([0, 500, 17], [300, 64, 1])
    c = paged_case(
        prefix, ext, 32, 8, 128, torch.bfloat16, "cuda", page_size=16, kv_dtype=torch.float8_e4m3fn
    )
    assert c.k_pool.dtype == torch.float8_e4m3fn
    args = c.decode_args() if op == "decode_attention" else c.extend_args()
    assert (
        close_ratio(load_impl(op, name)(*args), load_reference(op)(*args), *TOLERANCE[torch.bfloat16]) <= 1.0
    )


FP8_DECODE_SHAPES = [  # batch, max context, q heads, kv heads, head_dim, page size, q strided
    (1, 1, 32, 8, 128, 1, True),
    (1, 4096, 32, 8, 128, 1, False),
    (5, 65, 32, 8, 128, 16, True),
    (8, 1023, 32, 4, 64, 1, True),
    (16, 777, 8, 1, 128, 64, False),
    (32, 129, 9, 3, 64, 1, True),
    (4, 300, 8, 2, 256, 1, True),
    (64, 2049, 32, 8, 128, 16, True),
    (256, 1024, 32, 8, 128, 1, False),
    (64, 2049, 32, 8, 128, 64, True),  # pages of 64 and 128 at head dim 128: whole tiles by TMA
    (256, 1024, 32, 8, 128, 128, False),
]


@pytest.mark.parametrize(
    "shape", FP8_DECODE_SHAPES, ids=lambda s: "b{}-ctx{}-h{}/{}-d{}-page{}-strided{}".format(*s)
)
def test_tilelang_fp8_decode_matches_reference(shape: tuple) -> None:
    """The TileLang stage 1 (fp8 pools): ragged lengths, GQA groups 3-8, head dims 64-256, strided q, pages
    of 64 and more (TMA; the pool's unused slots are NaN, so a copy past a row's end shows)."""
    from runtime.gpu.kernels.decode_attention import tilelang, triton

    batch, ctx, hq, hkv, d, page, strided = shape
    lens = _lens(batch, ctx, seed=batch + ctx)
    c = paged_case(
        [n - 1 for n in lens], [1] * batch, hq, hkv, d, torch.bfloat16, "cuda", page_size=page,
        q_strided=strided, kv_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    if not tilelang.available(c.q.device):
        pytest.skip("TileLang on Hopper only")
    assert tilelang.supported(c.q, c.k_pool)
    want = load_reference("decode_attention")(*c.decode_args())
    for splits in (None, 1, 3, 16):  # one CTA per work item, or persistent CTAs where items outnumber them
        stage1 = functools.partial(tilelang.stage1, page_size=page)
        got = triton.split_kv(stage1, tilelang.BLOCK_N, *c.decode_args(), splits, None)
        assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0, splits
        # one split writes the output itself, here into every other row of a wider buffer
        wide = torch.full((batch, 2 * hq, d), float("nan"), dtype=c.q.dtype, device=c.q.device)
        out = wide[:, :hq]
        tilelang.stage1(*c.decode_args(), 1, out=out, page_size=page)
        assert close_ratio(out, want, *TOLERANCE[torch.bfloat16]) <= 1.0, (splits, "direct")
        assert wide[:, hq:].isnan().all()
    got = tilelang.decode_attention(*c.decode_args(), page_size=page)  # the engine's entry
    assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0


EXTEND_SHAPES = [  # prefix lens, extend lens, q heads, kv heads, head_dim, page size
    ([0], [1], 32, 8, 128, 1),
    ([0], [4096], 32, 8, 128, 1),
    ([1000], [333], 32, 32, 64, 16),
    ([0, 17, 500, 4000, 1], [65, 1, 127, 1, 1], 32, 4, 128, 1),  # mixed extend + decode
    ([i * 37 for i in range(64)], [1 + (i % 5 == 0) * 50 for i in range(64)], 16, 2, 64, 64),
    ([100, 0, 2047], [1, 1, 1], 9, 3, 64, 1),  # all decode through the extend kernel
]


@pytest.mark.parametrize("name", impl_names("extend_attention"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", EXTEND_SHAPES, ids=lambda s: "b{}-h{}/{}-d{}-page{}".format(len(s[0]), *s[2:])
)
def test_extend_attention_matches_reference(name: str, dtype: torch.dtype, shape: tuple) -> None:
    prefix, ext, hq, hkv, d, page = shape
    c = paged_case(prefix, ext, hq, hkv, d, dtype, "cuda", page_size=page)
    want = load_reference("extend_attention")(*c.extend_args())
    got = load_impl("extend_attention", name)(*c.extend_args())
    assert close_ratio(got, want, *TOLERANCE[dtype]) <= 1.0


PREFILL_SHAPES = [  # rows' new tokens, q heads, kv heads, head_dim
    ([1000] * 4, 32, 8, 128),
    ([1, 2, 127, 128, 129, 64, 700], 32, 8, 128),
    ([333, 5], 8, 8, 64),
    ([300, 77], 16, 2, 256),
    ([3000, 10], 32, 8, 128),  # past the short-row launch
]


@pytest.mark.parametrize("name", impl_names("prefill_attention"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", PREFILL_SHAPES, ids=lambda s: "n{}-max{}-h{}/{}-d{}".format(len(s[0]), max(s[0]), *s[1:])
)
@pytest.mark.parametrize("prefix", ["none", "cached", "cached_fp8"])
def test_prefill_attention_matches_reference(
    name: str, dtype: torch.dtype, shape: tuple, prefix: str
) -> None:
    """New keys from the step's own k/v: q, k, v slices of one fused qkv output, rows at offsets inside a
    longer step (the tokens around them belong to other kernels and stay untouched); with `cached`, each
    row (but one) also has a cached prefix of 1-1500 tokens gathered from a pool through shuffled slots."""
    lens, hq, hkv, d = shape
    g = torch.Generator("cuda").manual_seed(len(lens))
    lead, total = 3, sum(lens) + 5
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=g, device="cuda").to(dtype)
    q, k, v = (t.view(total, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    starts = torch.tensor([lead + sum(lens[:i]) for i in range(len(lens))], device="cuda")
    lens_t = torch.tensor(lens, device="cuda")
    cached = None
    if prefix != "none":
        if prefix == "cached_fp8" and dtype == torch.float32:
            pytest.skip("fp8 pools serve 16-bit models")
        prefixes = [0] + _lens(len(lens) - 1, 1500, seed=d)
        c = paged_case(prefixes, [1] * len(lens), hq, hkv, d, dtype, "cuda",
                       kv_dtype=torch.float8_e4m3fn if prefix == "cached_fp8" else None)  # fmt: skip
        cached = (c.k_pool, c.v_pool, c.req_to_token, c.rows, c.prefix_lens)
    canvas = torch.full((total, hq, d), 7.0, dtype=dtype, device="cuda")
    want = load_reference("prefill_attention")(
        q, k, v, starts, lens_t, d**-0.5, out=canvas.clone(), cached=cached
    )
    got = load_impl("prefill_attention", name)(
        q, k, v, starts, lens_t, d**-0.5, max(lens), out=canvas.clone(), cached=cached
    )
    assert close_ratio(got, want, *TOLERANCE[dtype]) <= 1.0
    assert bool((got[:lead] == 7).all()) and bool((got[lead + sum(lens) :] == 7).all())


def test_triton_backend_is_the_cuda_choice_and_matches_the_torch_backend() -> None:
    """Prefill, a mixed step and decode steps through both backends on one cache give the same outputs."""
    from runtime.gpu.attention.torch_ref import TorchAttentionBackend
    from runtime.gpu.attention.triton_backend import TritonAttentionBackend
    from runtime.gpu.kv_pool import MHAKVPool

    assert registry.op("decode_attention").select("cuda").name != "reference"
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    g = torch.Generator("cuda").manual_seed(0)
    cache = MHAKVPool(1, 20000, hkv, d, dtype, "cuda")
    r2t = torch.zeros(8, 4096, dtype=torch.int64, device="cuda")
    free = (torch.randperm(19999) + 1).tolist()
    lens = dict.fromkeys(range(1, 7), 0)
    # fresh prompts (the prefill kernel), one of one token behind a long one, decode rows ahead of them
    steps = [{1: 1000, 2: 37}, {1: 1, 2: 1, 3: 513, 4: 1}, {1: 1, 2: 1, 3: 1, 4: 1, 5: 2000}]
    # a row continuing its cached prefix (the extend kernel) next to a fresh one, in one step
    steps += [{1: 1, 2: 1, 3: 1, 4: 200, 5: 1, 6: 300}]
    steps += [dict.fromkeys(range(1, 7), 1)] * 3
    for ext in steps:
        rows = list(ext)
        out_loc, positions = [], []
        for row in rows:
            slots = [free.pop() for _ in range(ext[row])]
            r2t[row, lens[row] : lens[row] + ext[row]] = torch.tensor(slots, device="cuda")
            out_loc += slots
            positions += range(lens[row], lens[row] + ext[row])
        t = len(out_loc)
        q = torch.randn(t, hq, d, generator=g, device="cuda").to(dtype)
        k = torch.randn(t, hkv, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(t, hkv, d, generator=g, device="cuda").to(dtype)
        backends = (TorchAttentionBackend(hq, hkv, d, d**-0.5), TritonAttentionBackend(hq, hkv, d, d**-0.5))
        outs = backend_outputs(
            backends, q, k, v, rows=rows, positions=positions, out_loc=out_loc,
            prefix_lens=[lens[r] for r in rows], extend_lens=[ext[r] for r in rows], req_to_token=r2t,
            kv_pool=cache,
        )  # fmt: skip
        assert close_ratio(outs[1], outs[0], *TOLERANCE[dtype]) <= 1.0, ext
        for row in rows:
            lens[row] += ext[row]

"""MLA decode (op `mla_decode`): every implementation the registry lists matches the PyTorch reference
on CUDA. bf16 latent pool with page 64 and shuffled pages (unused slots NaN), d_qk 576 / d_v 512, h_q 16
and 128, batch 1..64, contexts 1..8K including non-multiples of 64, empty rows, split counts 1..64, and
the FlashMLA-signature front end (s_q 1 and 2, causal); for TileLang (Hopper) also the block-table entry
point, fp16, the float32 fallback and CUDA graphs. `pytest -s` prints each case's error ratio (<= 1
passes) and time."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.mla_decode.testing import mla_case
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio, impl_names, load_impl, load_reference

pytestmark = pytest.mark.gpu

OP = "mla_decode"


def _lens(batch: int, max_ctx: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=g).tolist()
    lens[0] = max_ctx
    return lens


def _check(name: str, got, want, got_lse, want_lse, dtype, t_ms: float) -> None:
    ratio = close_ratio(got, want, *TOLERANCE[dtype])
    fin = want_lse.isfinite()
    lse_ok = torch.equal(got_lse.isfinite(), fin)
    lse_ratio = close_ratio(got_lse[fin], want_lse[fin], 1e-3, 1e-3) if lse_ok else float("inf")
    print(
        f"\n  {name}: out error {ratio:.3f}x tol, lse error {lse_ratio:.3f}x tol, {t_ms:.3f} ms (incl. launch)"
    )
    assert ratio <= 1.0 and lse_ratio <= 1.0


SHAPES = [  # batch, max context, q heads
    (1, 1, 16),
    (1, 8192, 128),
    (2, 65, 128),
    (3, 1000, 16),
    (7, 4097, 128),
    (64, 63, 16),
    (64, 2049, 128),
    (64, 8192, 16),
    (64, 8000, 128),
]


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-ctx{}-h{}".format(*s))
def test_mla_decode_matches_reference(name: str, shape: tuple) -> None:
    batch, ctx, hq = shape
    dtype = torch.bfloat16
    c = mla_case(_lens(batch, ctx, seed=batch + ctx), hq, dtype, "cuda", page_size=64, seed=hq)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    fn = load_impl(OP, name)
    fn(*c.args())  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got, lse = fn(*c.args(), return_lse=True)
    torch.cuda.synchronize()
    _check(f"{name} {shape}", got, want, lse, want_lse, dtype, (time.perf_counter() - t0) * 1e3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_mla_decode_triton_other_dtypes_and_page_sizes(dtype: torch.dtype) -> None:
    for page in (1, 16):
        c = mla_case([300, 1, 0, 129], 16, dtype, "cuda", page_size=page, seed=page)
        want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
        got, lse = load_impl(OP, "triton")(*c.args(), return_lse=True)
        _check(f"triton {dtype} page {page}", got, want, lse, want_lse, dtype, 0.0)


@pytest.mark.parametrize("name", ["triton", "tilelang"])
@pytest.mark.parametrize("page", [1, 64])
def test_mla_decode_reads_an_fp8_pool(name: str, page: int) -> None:
    """An e4m3 latent pool (--kv-cache-dtype fp8_e4m3, scale 1; unused slots NaN) is upcast as it is
    loaded: the same answer as the reference on the same pool. TileLang hands it to the Triton kernel."""
    if name not in impl_names(OP):
        pytest.skip(f"{name} is not available here")
    c = mla_case([1000, 1, 0, 129, 64], 128, torch.bfloat16, "cuda", page_size=page, seed=page)
    c.pool = c.pool.to(torch.float8_e4m3fn)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    got, lse = load_impl(OP, name)(*c.args(), return_lse=True)
    _check(f"{name} fp8 pool page {page}", got, want, lse, want_lse, torch.bfloat16, 0.0)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_mla_decode_triton_any_split_count(num_splits: int) -> None:
    c = mla_case([0, 63, 64, 65, 3000], 128, torch.bfloat16, "cuda", page_size=64)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    got, lse = load_impl(OP, "triton")(*c.args(), num_splits=num_splits, return_lse=True)
    _check(f"triton splits={num_splits}", got, want, lse, want_lse, torch.bfloat16, 0.0)


@pytest.mark.parametrize("s_q", [1, 2])
def test_flash_mla_signature_front_end(s_q: int) -> None:
    """api.flash_mla_with_kvcache (block_table, cache_seqlens, [b, s_q, h, 576] q) on whatever the
    registry picks (FlashMLA when installed, else Triton) vs the reference per query."""
    from runtime.gpu.kernels.mla_decode import api

    lens = _lens(8, 3000, seed=s_q)
    c = mla_case(lens, 128, torch.bfloat16, "cuda", page_size=64, seed=3)
    q = torch.randn(8, s_q, 128, 576, device="cuda").to(torch.bfloat16)
    meta, splits = api.get_mla_metadata(c.cache_seqlens, s_q * 128, 1)
    out, lse = api.flash_mla_with_kvcache(
        q, c.k_cache(), c.block_table, c.cache_seqlens, 512, meta, splits, softmax_scale=c.scale, causal=True
    )
    assert out.shape == (8, s_q, 128, 512) and lse.shape == (8, 128, s_q)
    ref = load_reference(OP)
    for i in range(s_q):
        seen = c.seq_lens - (s_q - 1 - i)
        want, want_lse = ref(q[:, i], c.pool, c.req_to_token, c.rows, seen, c.scale, 512, return_lse=True)
        name = f"api[{registry.op(OP).select('cuda').name}] s_q={s_q} query {i}"
        _check(name, out[:, i], want, lse[:, :, i], want_lse, torch.bfloat16, 0.0)


def test_mla_decode_triton_under_cuda_graph() -> None:
    """Fixed split count: capturable, and replays give the reference answer for new inputs."""
    c = mla_case([1000, 64, 4000], 16, torch.bfloat16, "cuda", page_size=64)
    fn = load_impl(OP, "triton")
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device="cuda")
    fn(*c.args(), num_splits=8, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*c.args(), num_splits=8, out=out)
    c.q.copy_(torch.randn_like(c.q))
    g.replay()
    want = load_reference(OP)(*c.args())
    assert close_ratio(out, want, *TOLERANCE[torch.bfloat16]) <= 1.0


# ------------------------------------------------------------------ TileLang (Hopper, 64-head CTAs)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("hq", [16, 128])
def test_mla_decode_tilelang_any_split_count(hq: int, num_splits: int) -> None:
    """Empty rows, rows of one token, rows ending mid-page and splits longer than rows."""
    c = mla_case([0, 1, 63, 64, 65, 3000], hq, torch.bfloat16, "cuda", page_size=64, seed=num_splits)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    got, lse = load_impl(OP, "tilelang")(*c.args(), num_splits=num_splits, return_lse=True)
    _check(f"tilelang h={hq} splits={num_splits}", got, want, lse, want_lse, torch.bfloat16, 0.0)


@pytest.mark.parametrize("hq", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_mla_decode_tilelang_reads_a_block_table(hq: int, num_splits) -> None:
    """The FlashMLA inputs (block table of 64-token pages, int32) through the same kernel."""
    load_impl(OP, "tilelang")
    from runtime.gpu.kernels.mla_decode.tilelang import mla_decode_paged

    c = mla_case(_lens(9, 5000, seed=hq), hq, torch.bfloat16, "cuda", page_size=64, seed=hq + 1)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    rows = torch.arange(9, device="cuda")
    got, lse = mla_decode_paged(
        c.q, c.pool[:, 0], c.block_table, rows, c.seq_lens, c.scale, 512, 64, num_splits
    )
    _check(f"tilelang block table h={hq} splits={num_splits}", got, want, lse, want_lse, torch.bfloat16, 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_mla_decode_tilelang_fp16_and_the_fp32_fallback(dtype: torch.dtype) -> None:
    """fp16 runs the TileLang kernel; float32 (not a wgmma input here) is handed to the Triton one."""
    c = mla_case([300, 1, 0, 129], 16, dtype, "cuda", page_size=16, seed=5)
    want, want_lse = load_reference(OP)(*c.args(), return_lse=True)
    got, lse = load_impl(OP, "tilelang")(*c.args(), return_lse=True)
    _check(f"tilelang {dtype}", got, want, lse, want_lse, dtype, 0.0)


def test_mla_decode_tilelang_under_cuda_graph() -> None:
    c = mla_case([1000, 64, 4000], 128, torch.bfloat16, "cuda", page_size=64)
    fn = load_impl(OP, "tilelang")
    out = torch.empty(3, 128, 512, dtype=torch.bfloat16, device="cuda")
    for splits in (1, 8):
        fn(*c.args(), num_splits=splits, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*c.args(), num_splits=splits, out=out)
        c.q.copy_(torch.randn_like(c.q))
        g.replay()
        want = load_reference(OP)(*c.args())
        assert close_ratio(out, want, *TOLERANCE[torch.bfloat16]) <= 1.0, splits


@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("shape", [(8, 4096, 16), (64, 1000, 128), (3, 300, 16)], ids=str)
def test_mla_decode_with_several_query_tokens_matches_single_token_decode(q_len: int, shape: tuple) -> None:
    """Verify steps: each of a row's q_len tokens equals a single-query decode at its own length."""
    from runtime.gpu.kernels.mla_decode import MLA_DECODE

    batch, ctx, hq = shape
    lens = [max(q_len, ctx - 37 * i) for i in range(batch)]
    c = mla_case(lens, hq, torch.bfloat16, "cuda", page_size=64)
    q = torch.randn(batch * q_len, hq, c.q.shape[-1], device="cuda").to(torch.bfloat16)
    per_token = torch.tensor([n - q_len + 1 + i for n in lens for i in range(q_len)], device="cuda")
    rows = c.rows.repeat_interleave(q_len)
    ref = MLA_DECODE.named("reference").load()
    want = ref(q, c.pool, c.req_to_token, rows, per_token, c.scale)
    for impl in MLA_DECODE.implementations():
        if impl.name == "reference" or not impl.available(torch.device("cuda")):
            continue
        got = impl.load()(q, c.pool, c.req_to_token, c.rows, c.seq_lens, c.scale, q_len=q_len)
        assert close_ratio(got, want, *TOLERANCE[torch.bfloat16]) <= 1.0, impl.name


@pytest.mark.parametrize("q_len", [2, 4, 8])
@pytest.mark.parametrize("hq", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("table", ["per-token", "block"])
def test_mla_decode_tilelang_verify_rows_in_both_schedules(
    q_len: int, hq: int, num_splits, table: str
) -> None:
    """The TileLang kernel's virtual heads (a row's q_len tokens side by side): output and LSE equal the
    reference at each token's own length, with the gather (per-token table) and TMA (block table)
    schedules, splits that end inside the causal tail, rows as short as q_len, and a row's last tile
    that only its later tokens see."""
    load_impl(OP, "tilelang")
    from runtime.gpu.kernels.mla_decode.tilelang import mla_decode_paged

    lens = [q_len, 64 + q_len - 1, 65, 1000, 4096 + 2, 3000]
    c = mla_case(lens, hq, torch.bfloat16, "cuda", page_size=64, seed=q_len + hq)
    q = torch.randn(len(lens) * q_len, hq, c.q.shape[-1], device="cuda").to(torch.bfloat16)
    per_token = torch.tensor([n - q_len + 1 + i for n in lens for i in range(q_len)], device="cuda")
    rows = c.rows.repeat_interleave(q_len)
    want, want_lse = load_reference(OP)(q, c.pool, c.req_to_token, rows, per_token, c.scale, return_lse=True)
    if table == "block":
        args = (
            q,
            c.pool[:, 0],
            c.block_table,
            torch.arange(len(lens), device="cuda"),
            c.seq_lens,
            c.scale,
            512,
            64,
        )
    else:
        args = (q, c.pool[:, 0], c.req_to_token, c.rows, c.seq_lens, c.scale, 512, 1)
    got, lse = mla_decode_paged(*args, num_splits, q_len=q_len)
    _check(f"tilelang verify q_len={q_len} h={hq} splits={num_splits} {table}", got, want, lse, want_lse,
           torch.bfloat16, 0.0)  # fmt: skip

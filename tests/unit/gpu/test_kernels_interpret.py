"""Every Triton kernel matches its PyTorch reference on small cases, run on the CPU by the Triton
interpreter. TRITON_INTERPRET must be set before the kernels are defined and must not leak into other
tests (GPU tests in the same session would be interpreted), so the cases run in one subprocess: this
file run as a script prints {case: closeness ratio}; each test checks one case. Skipped without triton.

The interpreter rounds float32 -> bfloat16 by truncation (the GPU rounds to nearest), so bfloat16 cases
allow a few more ulps than on the device."""

from __future__ import annotations

import importlib.util

import torch

from runtime.gpu.kernels.testing import InterpreterCases

CASES = InterpreterCases()
case = CASES.case


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]


def _attention(kind: str, prefix: list[int], ext: list[int], hq: int, hkv: int, d: int, dtype, **kw) -> float:
    from runtime.gpu.kernels.testing import close_ratio, paged_case

    mod = importlib.import_module(f"runtime.gpu.kernels.{kind}_attention.triton")
    ref = importlib.import_module(f"runtime.gpu.kernels.{kind}_attention.reference")
    page = kw.pop("page_size", 1)
    kv_dtype = kw.pop("kv_dtype", None)
    c = paged_case(prefix, ext, hq, hkv, d, dtype, "cpu", page_size=page, seed=len(CASES), kv_dtype=kv_dtype)
    if kind == "decode":
        got = mod.decode_attention(*c.decode_args(), **kw)
        want = ref.decode_attention(*c.decode_args())
    else:
        got = mod.extend_attention(*c.extend_args())
        want = ref.extend_attention(*c.extend_args())
    return close_ratio(got, want, *_tol(dtype))


@case
def decode_gqa4_fp32_split4():
    return _attention("decode", [36, 299, 0, 130], [1] * 4, 8, 2, 64, torch.float32, num_splits=4)


@case
def decode_gqa3_bf16_page16():
    return _attention("decode", [200, 64, 1], [1] * 3, 9, 3, 64, torch.bfloat16, page_size=16, num_splits=2)


@case
def decode_mha_fp16_d128_auto_splits():
    return _attention("decode", [77, 5], [1, 1], 4, 4, 128, torch.float16)


@case
def decode_fp8_pool_prefetched_slots_split3():
    """An fp8 pool takes the slot-prefetching loop (PREFETCH_SLOTS[1]): rows shorter than, equal to and
    longer than a split, and a row of one token."""
    return _attention(
        "decode",
        [300, 127, 0, 1000],
        [1] * 4,
        8,
        2,
        64,
        torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        num_splits=3,
    )


@case
def decode_gqa8_bf16_more_splits_than_tokens():
    return _attention("decode", [2, 0], [1, 1], 8, 1, 64, torch.bfloat16, num_splits=8)


def _verify(prefix: list[int], q_len: int, hq: int, hkv: int, d: int, dtype, **kw) -> float:
    """Decode attention with q_len query tokens per row (a verify step) against the extend reference on
    the same case: the row's last q_len positions, each causal over its prefix and the new tokens."""
    from runtime.gpu.kernels.decode_attention import triton as mod
    from runtime.gpu.kernels.extend_attention import reference as extend_ref
    from runtime.gpu.kernels.testing import close_ratio, paged_case

    ext = [q_len] * len(prefix)
    c = paged_case(prefix, ext, hq, hkv, d, dtype, "cpu", seed=len(CASES), page_size=kw.pop("page_size", 1))
    got = mod.decode_attention(*c.decode_args(), q_len=q_len, **kw)
    return close_ratio(got, extend_ref.extend_attention(*c.extend_args()), *_tol(dtype))


@case
def decode_verify_q4_gqa4_fp32_split3():
    """Four query tokens a row: a split that starts past an early query's keys gives it nothing."""
    return _verify([61, 0, 130, 7], 4, 8, 2, 64, torch.float32, num_splits=3)


@case
def decode_verify_q2_mha_bf16_page16():
    return _verify([200, 1, 64], 2, 4, 4, 64, torch.bfloat16, page_size=16, num_splits=2)


@case
def decode_verify_q8_gqa2_fp16_auto_splits():
    return _verify([33, 300], 8, 4, 2, 128, torch.float16)


@case
def extend_mixed_fp32():
    return _attention("extend", [0, 5, 70, 3], [9, 1, 40, 1], 4, 2, 64, torch.float32)


@case
def extend_mixed_bf16_page4():
    return _attention("extend", [0, 130, 7], [70, 1, 3], 8, 2, 64, torch.bfloat16, page_size=4)


@case
def extend_prefix_fp16_d128():
    return _attention("extend", [33], [65], 2, 2, 128, torch.float16)


def _rms(dtype, residual: bool) -> float:
    from runtime.gpu.kernels.rms_norm import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 300, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(300, generator=g).to(dtype)
    got = triton.rms_norm(x, w, 1e-6, r if residual else None)
    want = reference.rms_norm(x, w, 1e-6, r if residual else None)
    if not residual:
        return close_ratio(got, want, *_tol(dtype))
    return max(close_ratio(a, b, *_tol(dtype)) for a, b in zip(got, want, strict=True))


@case
def rms_norm_fp32():
    return _rms(torch.float32, False)


@case
def rms_norm_residual_bf16():
    return _rms(torch.bfloat16, True)


@case
def rms_norm_residual_fp16():
    return _rms(torch.float16, True)


@case
def silu_and_mul_strided_bf16():
    from runtime.gpu.kernels.silu_and_mul import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    gu = torch.randn(7, 2 * 1500, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    g, u = gu.split(1500, -1)
    return close_ratio(triton.silu_and_mul(g, u), reference.silu_and_mul(g, u), *_tol(torch.bfloat16))


@case
def silu_and_mul_clamped_bf16():
    """DeepSeek-V4's limit: gate clamped above, up on both sides, before silu * up (values past it)."""
    from runtime.gpu.kernels.silu_and_mul import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    gu = (8 * torch.randn(5, 2 * 700, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    g, u = gu.split(700, -1)
    got, want = triton.silu_and_mul(g, u, limit=7.0), reference.silu_and_mul(g, u, limit=7.0)
    assert not torch.equal(want, reference.silu_and_mul(g, u))  # the clamp did something
    return close_ratio(got, want, *_tol(torch.bfloat16))


@case
def silu_and_mul_folded_norm_bf16():
    """With rms_x: gate and up scaled by each token's 1 / rms(rms_x) first (Llama's folded norms)."""
    from runtime.gpu.kernels.silu_and_mul import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(5)
    gu = torch.randn(3, 2 * 2100, generator=g).to(torch.bfloat16)
    x = (30 * torch.randn(3, 1100, generator=g)).to(torch.bfloat16)
    gate, up = gu.split(2100, -1)
    got, want = triton.silu_and_mul(gate, up, x, 1e-5), reference.silu_and_mul(gate, up, x, 1e-5)
    return close_ratio(got, want, *_tol(torch.bfloat16))


def _rope(dtype) -> float:
    from runtime.gpu.kernels.rope import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    qkv = torch.randn(6, 15 * 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], -1)
    q, k = q.view(6, 9, 64), k.view(6, 3, 64)
    pos = torch.tensor([0, 5, 1, 100, 7, 3])
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    e = torch.outer(torch.arange(128).float(), inv)
    e = torch.cat([e, e], -1)
    got = triton.rope(pos, q, k, e.cos(), e.sin())
    want = reference.rope(pos, q, k, e.cos(), e.sin())
    # float32: the interpreter's numpy arithmetic once read 1.2x the 1e-4 tolerance inside a full test
    # session (never alone, never on the GPU, where tests/gpu checks this kernel at 1e-4)
    tol = (3e-4, 3e-4) if dtype == torch.float32 else _tol(dtype)
    return max(close_ratio(a, b, *tol) for a, b in zip(got, want, strict=True))


@case
def rope_strided_fp32():
    return _rope(torch.float32)


@case
def rope_strided_bf16():
    return _rope(torch.bfloat16)


def _rope_interleaved(dtype, heads: int | None, half: int, inverse: bool, eps: float | None = None) -> float:
    """DeepSeek-V4's in-place form on a strided view (every other row of a larger tensor), YaRN-like
    scaling, positions up to 128K: the rotated channels match the reference's and the others are left
    exactly as they were, in x itself (with `eps`, the unit RMS norm first: then every channel is
    compared)."""
    from runtime.gpu.kernels.rope import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(half)
    dim = 4 * half
    shape = (10, dim) if heads is None else (10, heads, dim)
    base = torch.randn(2 * shape[0], *shape[1:], generator=g).to(dtype)
    pos = torch.tensor([0, 1, 7, 100, 4095, 4096, 65535, 131071, 3, 9])
    inv = 1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    orig = base.clone()
    x, want = base[::2], base[::2].clone()
    out = triton.rope_interleaved(x, pos, inv, 1.3, inverse, eps)
    reference.rope_interleaved(want, pos, inv, 1.3, inverse, eps)
    assert out is x and (
        eps is not None or torch.equal(x[..., : dim - 2 * half], orig[::2][..., : dim - 2 * half])
    )
    assert torch.equal(base[1::2], orig[1::2])  # the rows between the view's
    assert not torch.equal(want, orig[::2])  # the reference did rotate, in place
    return close_ratio(x, want, *_tol(dtype))


@case
def rope_interleaved_heads_fp32():
    return _rope_interleaved(torch.float32, 5, 16, False)


@case
def rope_interleaved_heads_inverse_bf16():
    return _rope_interleaved(torch.bfloat16, 19, 32, True)  # two head blocks, the second ragged


@case
def rope_interleaved_unit_rms_heads_bf16():
    return _rope_interleaved(torch.bfloat16, 19, 16, False, 1e-6)  # 19 heads of 64 channels: one block


@case
def rope_interleaved_unit_rms_rows_fp32():
    return _rope_interleaved(torch.float32, None, 12, True, 1e-6)  # [T, d], d = 48 (not a power of two)


@case
def rope_interleaved_rows_odd_half_bf16():
    return _rope_interleaved(torch.bfloat16, None, 12, False)  # [T, d], half not a power of two


@case
def rope_store_folded_norm_into_pools_bf16():
    """Rotated q returned, rotated k and plain v written at scattered slots, other slots untouched; q, k, v
    first scaled by 1 / rms(x) per token (the folded input norm)."""
    from runtime.gpu.kernels.rope import reference, triton

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 8 * 32, generator=g).to(torch.bfloat16)
    q, k, v = (t.reshape(5, -1, 32) for t in qkv.split([4 * 32, 2 * 32, 2 * 32], -1))
    pos, loc = torch.tensor([3, 0, 9, 1, 2]), torch.tensor([7, 2, 11, 4, 5])
    inv = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    e = torch.outer(torch.arange(16).float(), inv)
    e = torch.cat([e, e], -1)
    pools = [torch.randn(12, 2, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    pools += [p.clone() for p in pools]  # the reference writes into its own copies
    x = (30 * torch.randn(5, 1100, generator=g)).to(torch.bfloat16)  # folded input norm: scale by 1/rms(x)
    got_q = triton.rope_store(pos, q, k, v, e.cos(), e.sin(), loc, pools[0], pools[1], x, 1e-5)
    want_q = reference.rope_store(pos, q, k, v, e.cos(), e.sin(), loc, pools[2], pools[3], x, 1e-5)
    from runtime.gpu.kernels.testing import close_ratio

    return max(
        close_ratio(a, b, *_tol(torch.bfloat16))
        for a, b in [(got_q, want_q), *zip(pools[:2], pools[2:], strict=True)]
    )


@case
def prefill_rows_gqa_bf16_strided_with_and_without_a_cached_prefix():
    """The prefill kernel against its reference: new keys from the step's own k/v (slices of one qkv
    output), a row longer than a query block (keys left of the diagonal, unmasked), a row of one token,
    rows at offsets in the step; then the same rows behind cached prefixes (0, 70 and 5 tokens) read from
    an fp8 pool through a page table."""
    from runtime.gpu.kernels.extend_attention import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(5)
    lens, total = [150, 1, 40], 196
    qkv = torch.randn(total, 8 * 32, generator=g).to(torch.bfloat16)
    q, k, v = (t.reshape(total, -1, 32) for t in qkv.split([4 * 32, 2 * 32, 2 * 32], -1))
    starts, lens_t = torch.tensor([2, 152, 153]), torch.tensor(lens)
    canvas = torch.full((total, 4, 32), 7.0, dtype=torch.bfloat16)
    pools = [torch.randn(90, 2, 32, generator=g).to(torch.float8_e4m3fn) for _ in range(2)]
    r2t = torch.randperm(90, generator=g)[:80].view(4, 20).repeat(1, 4)  # row 1: 70 slots, some repeated
    cached = (*pools, r2t, torch.tensor([0, 1, 3]), torch.tensor([0, 70, 5]))
    worst = 0.0
    for c in (None, cached):
        got = triton.prefill_attention(q, k, v, starts, lens_t, 0.2, 150, out=canvas.clone(), cached=c)
        want = reference.prefill_attention(q, k, v, starts, lens_t, 0.2, out=canvas.clone(), cached=c)
        worst = max(worst, close_ratio(got, want, *_tol(torch.bfloat16)))
    return worst


@case
def triton_backend_matches_torch_backend_mixed_then_decode():
    """The backend on runner-shaped steps: mixed steps (fresh prompt, prefixed extend, decode rows between
    and around them; the leading decode rows of a mixed step go to the decode kernel) and then an
    all-decode step, against the PyTorch reference backend on the same cache."""
    from runtime.gpu.attention.torch_ref import TorchAttentionBackend
    from runtime.gpu.attention.triton_backend import TritonAttentionBackend
    from runtime.gpu.kernels.decode_attention.triton import decode_attention
    from runtime.gpu.kernels.extend_attention.triton import extend_attention
    from runtime.gpu.kernels.testing import backend_outputs, close_ratio
    from runtime.gpu.kv_pool import MHAKVPool

    hq, hkv, d, dtype = 6, 2, 64, torch.float32
    g = torch.Generator().manual_seed(4)
    cache = MHAKVPool(1, 400, hkv, d, dtype, "cpu")
    r2t = torch.zeros(5, 128, dtype=torch.int64)
    free = (torch.randperm(399, generator=g) + 1).tolist()
    lens = {1: 0, 2: 0, 3: 0}  # row -> tokens cached
    # history for rows 2 and 3 written straight into the cache
    for row, n in ((2, 40), (3, 17)):
        slots = torch.tensor([free.pop() for _ in range(n)])
        r2t[row, :n] = slots
        cache.k[0][slots] = torch.randn(n, hkv, d, generator=g)
        cache.v[0][slots] = torch.randn(n, hkv, d, generator=g)
        lens[row] = n
    ratios, decoded = [], []  # rows per decode-kernel call

    def decode_kernel(q, *args, **kw):
        decoded.append(q.shape[0])
        return decode_attention(q, *args, **kw)

    for ext in ({1: 12, 3: 1, 2: 5}, {2: 1, 1: 7, 3: 1}, {3: 1, 2: 1, 1: 4}, {1: 1, 2: 1, 3: 1}):
        rows = list(ext)
        out_loc, positions = [], []
        for row in rows:
            for i in range(ext[row]):
                slot = free.pop()
                r2t[row, lens[row] + i] = slot
                out_loc.append(slot)
                positions.append(lens[row] + i)
        t = len(out_loc)
        q = torch.randn(t, hq, d, generator=g)
        k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
        triton_backend = TritonAttentionBackend(hq, hkv, d, d**-0.5)
        triton_backend.decode_fn, triton_backend.extend_fn = decode_kernel, extend_attention
        outs = backend_outputs(
            (TorchAttentionBackend(hq, hkv, d, d**-0.5), triton_backend), q, k, v, rows=rows,
            positions=positions, out_loc=out_loc, prefix_lens=[lens[r] for r in rows],
            extend_lens=[ext[r] for r in rows], req_to_token=r2t, kv_pool=cache,
        )  # fmt: skip
        ratios.append(close_ratio(outs[1], outs[0], *_tol(dtype)))
        for row in rows:
            lens[row] += ext[row]
    assert decoded == [1, 2, 3], decoded  # step 1 leads with a prefill: no decode-kernel call
    return max(ratios)


# ------------------------------------------------------------------ DeepSeek ops


def _mla(lens: list[int], hq: int, page: int, dtype, splits=None, block_table: bool = False) -> float:
    """Small MLA (r 64 + rope 16) so the interpreter is quick; the kernel is shape-generic."""
    from runtime.gpu.kernels.mla_decode import reference, triton
    from runtime.gpu.kernels.mla_decode.testing import mla_case
    from runtime.gpu.kernels.testing import close_ratio

    c = mla_case(lens, hq, dtype, "cpu", page_size=page, kv_lora_rank=64, rope_dim=16, seed=len(lens) + hq)
    want, want_lse = reference.mla_decode(*c.args(), return_lse=True)
    if block_table:  # the FlashMLA layout: pages through block_table, PAGE = page
        rows = torch.arange(len(lens))
        got, lse = triton.mla_decode_paged(
            c.q, c.pool[:, 0], c.block_table, rows, c.seq_lens, c.scale, 64, page, splits
        )
    else:
        got, lse = triton.mla_decode(*c.args(), num_splits=splits, return_lse=True)
    if not torch.equal(lse.isinf(), want_lse.isinf()):
        return float("inf")
    fin = want_lse.isfinite()
    return max(close_ratio(got, want, *_tol(dtype)), close_ratio(lse[fin], want_lse[fin], 1e-4, 1e-4))


def _mla_verify(lens: list[int], q_len: int, hq: int, page: int, dtype, splits=None) -> float:
    """q_len query tokens per row (a verify step) against single-query decode of each token on its own
    (rows repeated, each token's length its position + 1), through the reference."""
    from runtime.gpu.kernels.mla_decode import reference, triton
    from runtime.gpu.kernels.mla_decode.testing import mla_case
    from runtime.gpu.kernels.testing import close_ratio

    c = mla_case(lens, hq, dtype, "cpu", page_size=page, kv_lora_rank=64, rope_dim=16, seed=len(lens) + q_len)
    gen = torch.Generator().manual_seed(q_len)
    q = torch.randn(len(lens) * q_len, hq, c.q.shape[-1], generator=gen).to(dtype)
    per_token = torch.tensor([n - q_len + 1 + i for n in lens for i in range(q_len)])
    rows = c.rows.repeat_interleave(q_len)
    want = reference.mla_decode(q, c.pool, c.req_to_token, rows, per_token, c.scale, 64)
    got = triton.mla_decode(q, c.pool, c.req_to_token, c.rows, c.seq_lens, c.scale, 64, splits, q_len=q_len)
    ref_multi = reference.mla_decode(q, c.pool, c.req_to_token, c.rows, c.seq_lens, c.scale, 64, q_len=q_len)
    return max(close_ratio(got, want, *_tol(dtype)), close_ratio(ref_multi, want, 1e-5, 1e-5))


@case
def mla_decode_verify_q4_fp32_split3_page16():
    return _mla_verify([37, 4, 100], 4, 20, 16, torch.float32, splits=3)


@case
def mla_decode_verify_q2_bf16_direct():
    return _mla_verify([70, 2], 2, 16, 64, torch.bfloat16, splits=1)


@case
def mla_decode_fp32_split3_page16_empty_row():
    return _mla([37, 1, 0, 100], 20, 16, torch.float32, splits=3)


@case
def mla_decode_bf16_page64_direct():
    return _mla([70, 5], 16, 64, torch.bfloat16, splits=1)


@case
def mla_decode_bf16_block_table_page16_split2():
    return _mla([50, 17, 33], 16, 16, torch.bfloat16, splits=2, block_table=True)


@case
def mla_flash_mla_signature_causal_sq2():
    """The FlashMLA-signature front end on our Triton kernel (s_q 2, causal) vs on the reference."""
    from runtime.gpu.kernels.mla_decode import api
    from runtime.gpu.kernels.mla_decode.testing import mla_case
    from runtime.gpu.kernels.testing import close_ratio

    c = mla_case([40, 9], 16, torch.float32, "cpu", page_size=16, kv_lora_rank=64, rope_dim=16, seed=5)
    q = torch.randn(2, 2, 16, 80, generator=torch.Generator().manual_seed(6))
    res, chosen = {}, api._impl
    try:
        for impl in ("triton", "reference"):
            api._impl = lambda device, impl=impl: impl
            args = (q, c.k_cache(), c.block_table, c.cache_seqlens, 64, None, None, c.scale, True)
            res[impl] = api.flash_mla_with_kvcache(*args)
    finally:
        api._impl = chosen
    (o, lse), (wo, wlse) = res["triton"], res["reference"]
    return max(close_ratio(o, wo, 1e-4, 1e-4), close_ratio(lse, wlse, 1e-4, 1e-4))


@case
def fp8_act_quant_bf16_ragged_k():
    """Scales exact; e4m3 values identical (the launcher rounds to e4m3 in torch under the interpreter)."""
    from runtime.gpu.kernels.fp8_gemm import reference, triton

    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    x[1, 128:256] = 0  # an all-zero group
    q, s = triton.fp8_act_quant(x)
    qr, sr = reference.act_quant(x)
    same = torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    return (s - sr).abs().max().item() / 1e-12 if same else float("inf")


@case
def fp8_weight_gemm_bf16_ragged():
    """W8A16 with ragged M, N and K (masked rows, columns and the last K group), bf16 in and out."""
    from runtime.gpu.kernels.fp8_gemm import reference, weight_only
    from runtime.gpu.kernels.testing import close_ratio
    from runtime.gpu.quant.fp8 import quantize

    g = torch.Generator().manual_seed(11)
    wq, ws = quantize(torch.randn(200, 300, generator=g) * 0.05, (128, 128))
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    want = reference.fp8_weight_gemm(x, wq, ws).float()
    return close_ratio(
        weight_only.fp8_weight_gemm(x, wq, ws).float(), want, 2e-3 * want.abs().max().item(), 1e-2
    )


@case
def fp8_weight_gemm_grouped_bf16():
    """W8A16 on a block-diagonal weight (DeepSeek-V4's o_a_proj): 2 groups of 128 rows, each reading its
    own 96 columns of x, in one launch."""
    from runtime.gpu.kernels.fp8_gemm import reference, weight_only
    from runtime.gpu.kernels.testing import close_ratio
    from runtime.gpu.quant.fp8 import quantize

    g = torch.Generator().manual_seed(12)
    wq, ws = quantize(torch.randn(256, 96, generator=g) * 0.05, (128, 128))
    x = torch.randn(3, 192, generator=g).to(torch.bfloat16)
    want = reference.fp8_weight_gemm(x, wq, ws, groups=2).float()
    got = weight_only.fp8_weight_gemm(x, wq, ws, groups=2).float()
    return close_ratio(got, want, 2e-3 * want.abs().max().item(), 1e-2)


def _fp8_gemm(m: int, n: int, k: int, split: int) -> float:
    from runtime.gpu.kernels.fp8_gemm import reference, triton
    from runtime.gpu.kernels.testing import close_ratio
    from runtime.gpu.quant.fp8 import quantize

    g = torch.Generator().manual_seed(m + n + k)
    xq, xs = reference.act_quant(torch.randn(m, k, generator=g))
    wq, ws = quantize(torch.randn(n, k, generator=g), (128, 128))
    cfg = triton.GemmConfig(block_m=16, block_n=32, split_k=split, num_warps=1, num_stages=1)
    got = triton.fp8_block_gemm(xq, xs, wq, ws, config=cfg)
    want = reference.fp8_block_gemm(xq, xs, wq, ws)
    return close_ratio(got, want, 1e-2 * want.abs().max().item(), 1.6e-2)


@case
def fp8_block_gemm_ragged_m_n_k():
    return _fp8_gemm(5, 100, 300, 1)


@case
def fp8_block_gemm_split_k3():
    return _fp8_gemm(17, 160, 384, 3)


def _mhc_pre(tokens: int, n: int, dim: int, dtype, norm: bool = False, iters: int = 20) -> float:
    """x (normed with `norm`) against the dtype's tolerance, post and comb (float32) against 1e-5."""
    from runtime.gpu.kernels.mhc import reference, triton
    from runtime.gpu.kernels.mhc.testing import mhc_case
    from runtime.gpu.kernels.testing import close_ratio

    c = mhc_case(tokens, n, dim, dtype, "cpu", iters=iters, seed=tokens + n + dim)
    (x, post, comb), (wx, wpost, wcomb) = (f(*c.pre_args(norm)) for f in (triton.mhc_pre, reference.mhc_pre))
    assert x.dtype == wx.dtype and post.dtype == comb.dtype == torch.float32
    return max(close_ratio(x, wx, *_tol(dtype)), close_ratio(post, wpost, 1e-5, 1e-5),
               close_ratio(comb, wcomb, 1e-5, 1e-5))  # fmt: skip


@case
def mhc_pre_fp32_n4_split_k_over_token_blocks():
    return _mhc_pre(37, 4, 96, torch.float32)


@case
def mhc_pre_bf16_n4_one_token_with_norm():
    return _mhc_pre(1, 4, 64, torch.bfloat16, norm=True)


@case
def mhc_pre_bf16_n3_with_norm_two_d_chunks():
    return _mhc_pre(3, 3, 2100, torch.bfloat16, norm=True, iters=7)  # D past BLOCK_D 2048, ragged


@case
def mhc_pre_fp32_n2_one_sinkhorn_iter():
    return _mhc_pre(6, 2, 24, torch.float32, iters=1)


@case
def mhc_pre_fp32_no_tokens():
    return _mhc_pre(0, 4, 64, torch.float32, norm=True)


def _mhc_post(tokens: int, n: int, dim: int, dtype) -> float:
    from runtime.gpu.kernels.mhc import reference, triton
    from runtime.gpu.kernels.mhc.testing import mhc_case
    from runtime.gpu.kernels.testing import close_ratio

    c = mhc_case(tokens, n, dim, dtype, "cpu", seed=tokens + n)
    _, post, comb = reference.mhc_pre(*c.pre_args())
    got = triton.mhc_post(c.h, c.out, post, comb)
    return close_ratio(got, reference.mhc_post(c.h, c.out, post, comb), *_tol(dtype))


@case
def mhc_post_fp32_n3_ragged_d():
    return _mhc_post(5, 3, 1100, torch.float32)


@case
def mhc_post_bf16_n4_one_token():
    return _mhc_post(1, 4, 256, torch.bfloat16)


@case
def mhc_post_bf16_n2():
    return _mhc_post(9, 2, 100, torch.bfloat16)


@case
def moe_grouped_gemm_bf16_empty_and_ragged_experts():
    from runtime.gpu.kernels.moe_grouped_gemm import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(8)
    counts = torch.tensor([5, 0, 17, 1, 40])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    x = torch.randn(int(counts.sum()), 70, generator=g).to(torch.bfloat16)
    w = torch.randn(5, 50, 70, generator=g).to(torch.bfloat16)
    got = triton.moe_grouped_gemm(x, w, offsets)
    return close_ratio(got, reference.moe_grouped_gemm(x, w, offsets), *_tol(torch.bfloat16))


def _sparse(
    tokens: int, dim: int, window: int, topk: int, dtype, sinks: bool = True, empty=(), heads=4, **kw
) -> float:
    """DeepSeek-V4 sparse attention, K = window + topk with -1 where a token has fewer rows; `empty`:
    tokens whose whole list is -1 (output 0, or only the sink's share)."""
    from runtime.gpu.kernels.sparse_attention import reference, triton
    from runtime.gpu.kernels.sparse_attention.testing import sparse_case
    from runtime.gpu.kernels.testing import close_ratio

    c = sparse_case(tokens, heads, dim, window, topk, dtype, "cpu", seed=tokens + dim + topk, **kw)
    for idx in (c.indices, c.extra_indices):
        if idx is not None:
            idx[list(empty)] = -1
    args = (c.q, c.kv, c.indices, c.sinks if sinks else None, c.scale)
    got = triton.sparse_attention(*args, **c.kwargs())
    return close_ratio(got, reference.sparse_attention(*args, **c.kwargs()), *_tol(dtype))


@case
def sparse_attention_fp32_d32_k7_early_tokens():
    return _sparse(6, 32, 3, 4, torch.float32, prefix=1)  # first tokens: window and entries padded -1


@case
def sparse_attention_bf16_d64_k16_ragged_topk_length():
    return _sparse(5, 64, 8, 8, torch.bfloat16, prefix=20, ragged=True)


@case
def sparse_attention_fp32_d64_two_sources_no_sink_empty_token():
    return _sparse(5, 64, 5, 11, torch.float32, sinks=False, empty=[2], prefix=30, two_sources=True)


@case
def sparse_attention_bf16_d32_k16_empty_token_with_sink():
    return _sparse(4, 32, 4, 12, torch.bfloat16, empty=[0, 3], prefix=40)


@case
def sparse_attention_fp32_20_heads_two_head_blocks():
    return _sparse(3, 32, 4, 3, torch.float32, heads=20, prefix=12)


def _sparse_shared_list(tokens: int, dim: int, entries: int, dtype) -> float:
    """The HCA call of V4's prefill: one entry list shared by every token (stride 0) and cut per token by
    `extra_topk_length`; the list's tail past a token's length would be NaN rows if read."""
    from runtime.gpu.kernels.sparse_attention import reference, triton
    from runtime.gpu.kernels.sparse_attention.testing import sparse_case
    from runtime.gpu.kernels.testing import close_ratio

    c = sparse_case(tokens, 4, dim, 4, 1, dtype, "cpu", prefix=entries, two_sources=True, seed=tokens + dim)
    shared = torch.randperm(c.extra_kv.shape[0] - 4, generator=torch.Generator().manual_seed(0))[:entries]
    lengths = torch.randint(0, entries + 1, (tokens,), generator=torch.Generator().manual_seed(1)).int()
    kw = dict(extra_kv=c.extra_kv, extra_indices=shared.int().expand(tokens, -1), extra_topk_length=lengths)
    args = (c.q, c.kv, c.indices, c.sinks, c.scale)
    return close_ratio(
        triton.sparse_attention(*args, **kw), reference.sparse_attention(*args, **kw), *_tol(dtype)
    )


@case
def sparse_attention_fp32_shared_entry_list_cut_per_token():
    return _sparse_shared_list(7, 32, 9, torch.float32)


def _index(tokens: int, heads: int, dim: int, entries: int, dtype, prefix: int = 0) -> float:
    """Lightning Indexer scores: blocks no query sees (-inf, nothing loaded), partly seen blocks."""
    from runtime.gpu.kernels.index_scores import reference, triton
    from runtime.gpu.kernels.index_scores.testing import index_case, score_ratio

    c = index_case(tokens, heads, dim, entries, dtype, "cpu", prefix=prefix, seed=tokens + entries)
    return score_ratio(triton.index_scores(*c.args()), reference.index_scores(*c.args()), *_tol(dtype))


@case
def index_scores_fp32_causal_start():
    return _index(37, 3, 16, 40, torch.float32)  # queries 0..3 see nothing; entry blocks 1, 2 no query sees


@case
def index_scores_bf16_c32_after_prefix():
    return _index(20, 5, 32, 40, torch.bfloat16, prefix=100)


@case
def index_scores_fp32_c24_padded_many_blocks():
    return _index(18, 2, 24, 70, torch.float32, prefix=200)  # c padded to 32, 5 entry blocks


def _row_index(lengths: list[int], q_len: int, heads: int, dim: int, width: int, dtype) -> float:
    """Indexer scores of decode / verify rows over their own entries in a shared pool, through a table
    whose entries past a row's end point outside the pool (never read)."""
    from runtime.gpu.kernels.index_scores import reference, row_triton
    from runtime.gpu.kernels.index_scores.testing import row_case, score_ratio

    c = row_case(lengths, q_len, heads, dim, width, dtype, "cpu", seed=len(lengths) + width)
    want = reference.row_index_scores(*c.args())
    return score_ratio(row_triton.row_index_scores(*c.args()), want, *_tol(dtype))


@case
def row_index_scores_decode_fp32_short_and_padding_rows():
    return _row_index([37, 3, -1, 90], 1, 3, 16, 40, torch.float32)  # rows past, inside, before the blocks


@case
def row_index_scores_verify_q4_bf16_c32():
    return _row_index([100, 14, -4, 61], 4, 5, 32, 48, torch.bfloat16)  # windows closing mid-row; padding


@case
def row_index_scores_verify_q3_fp32_c24_padded_heads():
    return _row_index([200, 7], 3, 20, 24, 70, torch.float32)  # heads padded to 32, c to 32


def _moe_blocks(t: int, k: int, d: int, ep: int, per_rank: int, cap: int, dtype) -> float:
    """Pack, a stand-in for the experts (each row scaled by its weight and its local expert + 1), combine:
    Triton against the reference. Also: every pair took a row of its own in its destination's block (the
    same row in both), and the rows no pair took are cleared."""
    from runtime.gpu.kernels.moe_blocks import reference
    from runtime.gpu.kernels.moe_blocks import triton as kernels
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(len(CASES))
    x = torch.randn(t, d, generator=g).to(dtype)
    weights = torch.rand(t, k, generator=g)
    slots = torch.stack([torch.randperm(ep * per_rank, generator=g)[:k] for _ in range(t)])

    def through_experts(pack):
        rows, w, ids, where = pack(x, weights, slots, per_rank, ep, cap)
        dest = torch.div(where, cap, rounding_mode="floor")
        assert where.unique().numel() == t * k and (dest == slots // per_rank).all()
        untouched = torch.ones(ep * cap, dtype=torch.bool)
        untouched[where.reshape(-1)] = False
        assert (rows[untouched] == 0).all() and (w[untouched] == 0).all() and (ids[untouched] == 0).all()
        return (rows.float() * w[:, None] * (ids[:, None] + 1)).to(dtype), where

    got, got_where = through_experts(kernels.pack)
    want, want_where = through_experts(reference.pack)
    assert torch.equal(got_where, want_where)  # the same layout: pair order inside each block
    return close_ratio(kernels.combine(got, got_where), reference.combine(want, want_where), *_tol(dtype))


@case
def moe_blocks_three_ranks_bf16_d300():
    return _moe_blocks(7, 3, 300, ep=3, per_rank=4, cap=21, dtype=torch.bfloat16)


@case
def moe_blocks_one_rank_full_blocks_fp32():
    """One rank, cap = T * k: the blocks are full, so they are not cleared first (the world-size-1 path)."""
    return _moe_blocks(5, 2, 64, ep=1, per_rank=8, cap=10, dtype=torch.float32)


def _pool_closing(overlap: bool, rate: int, d: int, q_len: int, dtype) -> float:
    """V4's decode compressors: B groups of q_len places at positions around window boundaries (window 0
    among them: no Ca tokens), runs cut short (a group whose later places are another row's), each
    window's raw tokens from the row's tail or the step, entries through a shuffled page table, windows
    that do not close (their rows must keep their values), a trailing rope of 2 * 8 channels."""
    from runtime.gpu.kernels.compress_pool import reference, triton
    from runtime.gpu.kernels.testing import close_ratio

    g = torch.Generator().manual_seed(rate + d + q_len)
    span, width = (2 * rate, 2 * d) if overlap else (rate, d)
    firsts = [0, rate - 1, 3 * rate - 2, 5 * rate - 1, 2 * rate]  # each group's first position
    b, r, max_len = len(firsts), 6, 8 * rate
    t = b * q_len
    group_rows = torch.tensor([4, 1, 0, 3, 5])
    rows = group_rows.repeat_interleave(q_len)
    positions = (torch.tensor(firsts)[:, None] + torch.arange(q_len)).flatten()
    in_run = torch.ones(b, q_len, dtype=torch.bool)
    if q_len > 1:
        in_run[3, q_len // 2 :] = False  # group 3's run ends mid-group
        rows.view(b, q_len)[3, q_len // 2 :] = 2
    kv, gate = (torch.randn(t, width, generator=g).to(dtype) for _ in range(2))
    tail_kv, tail_gate = (torch.randn(r, span, width, generator=g).to(dtype) for _ in range(2))
    pages = torch.randperm(r * max_len // rate, generator=g)  # entry rows: page w of row i, shuffled
    table = (pages.view(r, -1).repeat_interleave(rate, 1) * rate + torch.arange(max_len) % rate).int()
    bias = torch.randn(rate, width, generator=g)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    args = (kv, gate, tail_kv, tail_gate, rows, positions, in_run, table)
    tail = (bias, overlap, norm_w, 1e-6, inv, 1.3)
    got, want = (torch.randn(pages.numel(), d, generator=g).to(dtype) for _ in range(2))
    want.copy_(got)
    orig = got.clone()
    triton.pool_closing(*args, got, *tail)
    reference.pool_closing(*args, want, *tail)
    closes, _, dst = reference.closing_windows(rows, positions, in_run, table, rate, span)[:3]
    untouched = torch.ones(pages.numel(), dtype=torch.bool)
    untouched[dst[closes]] = False
    assert closes.any() and not closes.all() and torch.equal(got[untouched], orig[untouched])
    assert not torch.equal(want, orig)
    return close_ratio(got, want, *_tol(dtype))


@case
def pool_closing_csa_overlap_bf16_verify():
    return _pool_closing(True, 4, 64, 6, torch.bfloat16)  # 6 places: up to 2 windows a group


@case
def pool_closing_csa_overlap_fp32_decode():
    return _pool_closing(True, 4, 32, 1, torch.float32)


@case
def pool_closing_hca_fp32_verify():
    return _pool_closing(False, 32, 32, 4, torch.float32)  # span 32: two loop steps of 16 tokens


# ------------------------------------------------------------------ the pytest side

test_triton_kernel_matches_reference_under_interpreter = CASES.pytest_test(__file__)


if __name__ == "__main__":
    CASES.main()

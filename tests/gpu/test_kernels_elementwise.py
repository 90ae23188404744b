"""Fused RMSNorm(+residual), SwiGLU activation and RoPE implementations match their references on CUDA."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.testing import close_ratio

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Elementwise kernels round like the reference; allow one ulp of the dtype for fma/exp differences.
# float16: two ulps, since over 16M elements an rsqrt rounding difference can flip one more bit.
ULP = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (8e-3, 8e-3)}


def _pair(op: str) -> list[tuple]:
    impls = registry.op(op).implementations()
    ref = next(i for i in impls if i.name == "reference")
    return [(i, ref) for i in impls if i.name != "reference"]


def _load(impl):
    if not impl.available(torch.device("cuda")):
        pytest.skip(f"{impl.op}/{impl.name} not available here")
    return impl.load()


@pytest.mark.parametrize("impls", _pair("rms_norm"), ids=lambda p: p[0].name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 576), (7, 4096), (333, 5120), (2048, 8192), (3, 100)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(impls, dtype, tokens: int, hidden: int, residual: bool) -> None:
    fn, ref = _load(impls[0]), impls[1].load()
    g = torch.Generator("cuda").manual_seed(tokens)
    x, r = (torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    got = fn(x, w, 1e-5, r if residual else None)
    want = ref(x, w, 1e-5, r if residual else None)
    if residual:
        assert close_ratio(got[1], want[1], *ULP[dtype]) <= 1.0
        got, want = got[0], want[0]
    assert close_ratio(got, want, *ULP[dtype]) <= 1.0


@pytest.mark.parametrize("impls", _pair("silu_and_mul"), ids=lambda p: p[0].name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (64, 14336), (1000, 1000)])
@pytest.mark.parametrize("rms", [False, True], ids=["plain", "folded_norm"])
def test_silu_and_mul_matches_reference_on_merged_gate_up_slices(
    impls, dtype, tokens: int, inter: int, rms: bool
) -> None:
    fn, ref = _load(impls[0]), impls[1].load()
    gu = (3 * torch.randn(tokens, 2 * inter, device="cuda")).to(dtype)
    gate, up = gu.split(inter, dim=-1)
    extra = (_residual_stream(tokens, dtype), 1e-5) if rms else ()
    assert close_ratio(fn(gate, up, *extra), ref(gate, up, *extra), *ULP[dtype]) <= 1.0


def _residual_stream(tokens: int, dtype: torch.dtype, hidden: int = 4096) -> torch.Tensor:
    """An un-normalised hidden state (rms far from 1), as the folded-norm kernels read it."""
    return (20 * torch.randn(tokens, hidden, device="cuda")).to(dtype)


@pytest.mark.parametrize("impls", _pair("rope"), ids=lambda p: p[0].name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "tokens,hq,hkv,d", [(1, 32, 8, 128), (100, 9, 3, 64), (4096, 32, 8, 128), (5, 4, 4, 80)]
)
def test_rope_matches_reference_on_qkv_slices(impls, dtype, tokens: int, hq: int, hkv: int, d: int) -> None:
    from transformers import LlamaConfig

    from runtime.gpu.layers.rotary import RotaryEmbedding

    fn, ref = _load(impls[0]), impls[1].load()
    config = LlamaConfig(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    rot = RotaryEmbedding(config, d, 32768)
    rot.build("cuda")
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda").to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    got, want = fn(pos, q, k, rot.cos, rot.sin), ref(pos, q, k, rot.cos, rot.sin)
    module = rot(pos, q, k)  # the layer, which now dispatches to the registry's choice on CUDA
    for a, b, m in zip(got, want, module, strict=True):
        assert close_ratio(a, b, *ULP[dtype]) <= 1.0
        assert close_ratio(m, b, *ULP[dtype]) <= 1.0


@pytest.mark.parametrize("impls", _pair("rope_store"), ids=lambda p: p[0].name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hq,hkv,d", [(1, 32, 8, 128), (100, 9, 3, 64), (4096, 32, 8, 128)])
@pytest.mark.parametrize("rms", [False, True], ids=["plain", "folded_norm"])
@pytest.mark.parametrize("write_kv", [False, True], ids=["", "write_kv"])
def test_rope_store_matches_reference_and_writes_only_its_slots(
    impls, dtype, tokens: int, hq: int, hkv: int, d: int, rms: bool, write_kv: bool
) -> None:
    fn, ref = _load(impls[0]), impls[1].load()
    g = torch.Generator("cuda").manual_seed(tokens)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    e = torch.outer(torch.arange(8192, device="cuda").float(), inv)
    cos, sin = torch.cat([e, e], -1).cos(), torch.cat([e, e], -1).sin()
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g, device="cuda").to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
    pos = torch.randint(0, 8192, (tokens,), generator=g, device="cuda")
    loc = torch.randperm(2 * tokens + 3, generator=g, device="cuda")[:tokens]
    pools = [torch.randn(2 * tokens + 3, hkv, d, generator=g, device="cuda").to(dtype) for _ in range(2)]
    if dtype == torch.bfloat16 and tokens == 100:  # also into an fp8 pool (--kv-cache-dtype fp8_e4m3)
        pools = [p.to(torch.float8_e4m3fn) for p in pools]
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    x, eps = (_residual_stream(tokens, dtype, 1000), 1e-6) if rms else (None, 0.0)
    qkv_theirs = qkv.clone()  # write_kv overwrites k and v: each side gets its own
    q2, k2, v2 = (t.view(tokens, -1, d) for t in qkv_theirs.split([hq * d, hkv * d, hkv * d], dim=-1))
    got = fn(pos, q, k, v, cos, sin, loc, *mine, x, eps, write_kv)
    want = ref(pos, q2, k2, v2, cos, sin, loc, *theirs, x, eps, write_kv)
    assert close_ratio(got, want, *ULP[dtype]) <= 1.0
    for a, b in zip(mine, theirs, strict=True):
        assert close_ratio(a, b, *ULP[dtype]) <= 1.0
    # k and v as stored (rotated, scaled, in their own dtype) when write_kv; untouched otherwise
    assert close_ratio(qkv, qkv_theirs, *ULP[dtype]) <= 1.0
    assert torch.equal(qkv[:, : hq * d], qkv_theirs[:, : hq * d])  # q is returned, never overwritten


@pytest.mark.parametrize("impls", _pair("rope_interleaved"), ids=lambda p: p[0].name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 64, 512), (64, 64, 512), (16384, 64, 512), (4096, 512), (333, 64, 128)], ids=str
)  # V4-Flash: attention q / o, the K=V row, the indexer's q
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_interleaved_matches_reference_in_place(impls, dtype, shape, inverse: bool) -> None:
    """Positions up to 128K (angles past 1e5 radians: cos and sin computed in the program must hold
    float32 accuracy there), YaRN-like scaling; the unrotated channels are left bit for bit."""
    import triton.testing

    fn, ref = _load(impls[0]), impls[1].load()
    x = torch.randn(*shape, device="cuda").to(dtype)
    pos = torch.randint(0, 131072, (shape[0],), device="cuda")
    pos[0] = 131071
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    got, want = x.clone(), x.clone()
    assert fn(got, pos, inv, 1.2, inverse) is got
    ref(want, pos, inv, 1.2, inverse)
    assert torch.equal(got[..., :-64], x[..., :-64])
    assert close_ratio(got, want, *ULP[dtype]) <= 1.0
    if shape[0] == 16384:
        ms = triton.testing.do_bench(lambda: fn(got, pos, inv, 1.2, inverse), warmup=5, rep=20)
        ms_ref = triton.testing.do_bench(lambda: ref(want, pos, inv, 1.2, inverse), warmup=5, rep=20)
        print(f"\n  rope_interleaved {shape} {dtype}: {ms * 1e3:.1f} us, reference {ms_ref * 1e3:.1f} us")

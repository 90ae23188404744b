"""mHC ops (`mhc_pre` with and without the fused RMSNorm, `mhc_post`) vs the reference on CUDA at
DeepSeek-V4-Flash shapes (4 streams, D 4096, 20 Sinkhorn iterations) for decode- and prefill-sized
batches, and the V4 layer dispatching to them. `pytest -s` prints each call's time and bandwidth.

x against the dtype's tolerance; post and comb (float32 either way) against 1e-5: the projection is a
float32 ieee dot on both sides, so only summation order and exp / rsqrt rounding differ."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.mhc.reference import mhc_post, mhc_pre
from runtime.gpu.kernels.mhc.testing import mhc_case
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio
from runtime.gpu.layers import RMSNorm
from runtime.gpu.models.deepseek_v4.mhc import HyperConnection

pytestmark = pytest.mark.gpu

N, D, ITERS = 4, 4096, 20
MIX_TOL = (1e-5, 1e-5)
DEVICE = "cuda"  # set to "cpu" (triton marked available there) under TRITON_INTERPRET=1 to run the bodies


def _impls(op: str) -> list:
    impls = registry.op(op).implementations()
    return [i for i in impls if i.name != "reference"]


def _pair(impl) -> tuple:
    if not impl.available(torch.device(DEVICE)):
        pytest.skip(f"{impl.op}/{impl.name} not available here")
    ref = registry.op(impl.op).named("reference")
    return impl.load(), ref.load()


@pytest.fixture(autouse=True)
def _no_tf32():  # the reference's float32 F.linear must stay float32
    if DEVICE != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _timed(fn, nbytes: float, label: str) -> None:
    if DEVICE != "cuda":
        return
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=5, rep=20)
    print(f"\n  {label}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")


@pytest.mark.parametrize("impl", _impls("mhc_pre"), ids=lambda i: i.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("norm", [False, True], ids=["x", "x_normed"])
def test_mhc_pre_matches_reference_at_v4_flash_shapes(impl, dtype, tokens: int, norm: bool) -> None:
    fn, ref = _pair(impl)
    c = mhc_case(tokens, N, D, dtype, DEVICE, iters=ITERS, seed=tokens)
    x, post, comb = fn(*c.pre_args(norm))
    wx, wpost, wcomb = ref(*c.pre_args(norm))
    assert x.dtype == wx.dtype and x.shape == (tokens, D)
    assert post.dtype == comb.dtype == torch.float32
    assert close_ratio(x, wx, *TOLERANCE[dtype]) <= 1.0
    assert close_ratio(post, wpost, *MIX_TOL) <= 1.0
    assert close_ratio(comb, wcomb, *MIX_TOL) <= 1.0
    elem = c.h.element_size()
    nbytes = c.h.numel() * elem + c.fn.numel() * 4 + tokens * D * elem + tokens * (N + N * N) * 4
    _timed(lambda: fn(*c.pre_args(norm)), nbytes, f"mhc_pre {impl.name} T={tokens} {dtype} norm={norm}")


@pytest.mark.parametrize("impl", _impls("mhc_post"), ids=lambda i: i.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_mhc_post_matches_reference_at_v4_flash_shapes(impl, dtype, tokens: int) -> None:
    fn, ref = _pair(impl)
    c = mhc_case(tokens, N, D, dtype, DEVICE, iters=ITERS, seed=tokens + 1)
    _, post, comb = mhc_pre(*c.pre_args())
    got, want = fn(c.h, c.out, post, comb), ref(c.h, c.out, post, comb)
    assert got.dtype == c.h.dtype and got.shape == c.h.shape
    assert close_ratio(got, want, *TOLERANCE[dtype]) <= 1.0
    nbytes = (2 * c.h.numel() + c.out.numel()) * c.h.element_size() + tokens * (N + N * N) * 4
    _timed(lambda: fn(c.h, c.out, post, comb), nbytes, f"mhc_post {impl.name} T={tokens} {dtype}")


def test_hyper_connection_layer_matches_the_reference_ops_on_its_weights() -> None:
    """The V4 layer on the device (the registry's choice, fused input norm included)."""

    c = mhc_case(64, N, D, torch.bfloat16, DEVICE, iters=ITERS, seed=7)
    layer = HyperConnection(N, D, ITERS, 1e-6, 1e-6).to(DEVICE)
    norm = RMSNorm(D, 1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        layer.fn.copy_(c.fn)
        layer.base.copy_(c.base)
        layer.scale.copy_(c.scale)
        norm.weight.copy_(c.norm_weight)
        x, post, comb = layer(c.h, norm)
        wx, wpost, wcomb = mhc_pre(*c.pre_args(norm=True))
        new = HyperConnection.merge(c.h, c.out, post, comb)
        want = mhc_post(c.h, c.out, wpost, wcomb)
    assert close_ratio(x, wx, *TOLERANCE[torch.bfloat16]) <= 1.0
    assert close_ratio(comb, wcomb, *MIX_TOL) <= 1.0
    assert close_ratio(new, want, *TOLERANCE[torch.bfloat16]) <= 1.0

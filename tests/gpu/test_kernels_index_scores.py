"""Lightning Indexer scores (op `index_scores`, DeepSeek-V4's CSA): every implementation the registry
lists matches the PyTorch reference on CUDA at V4-Flash shapes (64 indexer heads, c 128), for a prefill
tile (4096 queries x 16384 entries after 60K tokens, the backend's default tiles) and a request's first
queries (most entry blocks seen by none), bf16 and fp32; and the tiled top-k on the device picks what
the reference picks. `pytest -s` prints each case's error ratio (<= 1 passes) and time."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.gpu.kernels.index_scores.testing import index_case, score_ratio
from runtime.gpu.kernels.testing import TOLERANCE, impl_names, load_impl, load_reference

pytestmark = pytest.mark.gpu

OP = "index_scores"
H, C = 64, 128  # V4-Flash's index_n_heads, index_head_dim


def _check(label: str, fn, c, dtype: torch.dtype) -> None:
    want = load_reference(OP)(*c.args())
    fn(*c.args())  # compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = fn(*c.args())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    seen = int(c.visible.clamp(max=c.keys.shape[0]).sum())
    tflops = 2 * seen * H * C / (ms * 1e-3) / 1e12
    ratio = score_ratio(got, want, *TOLERANCE[dtype])
    print(
        f"\n  {label}: error {ratio:.3f}x tol, {ms:.3f} ms (incl. launch), {tflops:.1f} TFLOP/s on seen entries"
    )
    assert ratio <= 1.0


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_v4_flash_prefill_tile_matches_reference(name: str, dtype: torch.dtype) -> None:
    c = index_case(4096, H, C, 16384, dtype, "cuda", prefix=61440)
    _check(f"{name} {dtype} 4096 x 16384", load_impl(OP, name), c, dtype)


@pytest.mark.parametrize("name", impl_names(OP))
def test_first_queries_of_a_request(name: str) -> None:
    """Positions 0..1999 over 500 entries: queries 0..3 see none, most blocks are seen by no query."""
    c = index_case(2000, H, C, 500, torch.bfloat16, "cuda", seed=1)
    _check(f"{name} causal start", load_impl(OP, name), c, torch.bfloat16)


def test_indexer_select_on_cuda_picks_the_reference_top_k(monkeypatch) -> None:
    """`Indexer.select` (float32, entry tiles of 1000 over 3000 entries) through the registry's op on the
    device picks the same entries as through the reference."""
    from runtime.gpu.kernels.index_scores import INDEX_SCORES
    from runtime.gpu.models.deepseek_v4.compressor import Indexer
    from runtime.gpu.models.deepseek_v4.rope import InterleavedRope
    from runtime.gpu.testing import tiny_deepseek_v4_config

    config = tiny_deepseek_v4_config(index_topk=64, index_n_heads=H, index_head_dim=C)
    torch.manual_seed(0)
    indexer, rope = Indexer(config).cuda().eval(), InterleavedRope(config, "compress")
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(512, config.hidden_size, generator=g, device="cuda")
    qr = torch.randn(512, config.q_lora_rank, generator=g, device="cuda")
    keys = torch.randn(3000, C, generator=g, device="cuda")
    pos = torch.arange(11488, 12000, device="cuda")
    with torch.no_grad():
        got = indexer.select(x, qr, pos, keys, rope, 1000)
        monkeypatch.setattr(INDEX_SCORES, "get", lambda device: load_reference(OP))
        want = indexer.select(x, qr, pos, keys, rope, 1000)
    assert torch.equal(got.sort(1).values, want.sort(1).values)


ROW_OP = "row_index_scores"


@pytest.mark.parametrize("name", impl_names(ROW_OP))
@pytest.mark.parametrize(
    ("rows", "q_len", "context"),
    [(64, 1, 8192), (64, 4, 8192), (32, 4, 131072), (8, 1, 131072)],
    ids=["decode-B64-8K", "verify-B64-8K", "verify-B32-128K", "decode-B8-128K"],
)
def test_row_scores_at_v4_flash_decode_and_verify_shapes(
    name: str, rows: int, q_len: int, context: int
) -> None:
    """Decode / verify rows of V4-Flash's indexer (64 heads, c 128, rate 4) over their own entries of a
    shared pool; the rows' lengths spread over the context, so most programs of the short rows skip.
    Prints the time and the bandwidth of the key rows read."""
    from runtime.gpu.kernels.index_scores.testing import row_case

    gen = torch.Generator().manual_seed(rows)
    lengths = torch.randint(context // 2, context - q_len, (rows,), generator=gen).tolist()
    c = row_case(lengths, q_len, H, C, context // 4, torch.bfloat16, "cuda", seed=rows + q_len)
    fn = load_impl(ROW_OP, name)
    want = load_reference(ROW_OP)(*c.args())
    fn(*c.args())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = fn(*c.args())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    seen = int(c.visible.view(rows, q_len).amax(1).sum())
    gbs = seen * C * 2 / (ms * 1e-3) / 1e9
    ratio = score_ratio(got, want, *TOLERANCE[torch.bfloat16])
    print(
        f"\n  {name} B={rows} q_len={q_len} ctx={context}: error {ratio:.3f}x tol, {ms:.3f} ms, {gbs:.0f} GB/s keys"
    )
    assert ratio <= 1.0

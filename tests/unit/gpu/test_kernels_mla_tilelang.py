"""The MLA decode kernels' host side, on the CPU: where the TileLang kernel sits in the registry, when it
is available, how many KV splits the launcher picks, the bench's case layouts, and the FlashMLA front
end's metadata (the kernels themselves are tested on CUDA in tests/gpu/test_kernels_mla.py; the bench's
FlashMLA calls in tests/unit/benchmarks/test_mla_decode_benchmark.py)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.mla_decode import tilelang as tl


def test_tilelang_comes_after_flash_mla_and_before_triton() -> None:
    names = [i.name for i in registry.op("mla_decode").implementations()]
    assert names == ["flash_mla", "tilelang", "triton", "reference"]


def test_tilelang_is_not_available_on_the_cpu() -> None:
    impl = registry.op("mla_decode").named("tilelang")
    assert not impl.available(torch.device("cpu"))
    assert registry.op("mla_decode").select("cpu").name == "reference"


def test_tilelang_needs_an_importable_tilelang(monkeypatch) -> None:
    monkeypatch.setattr(tl, "_importable", lambda: False)
    monkeypatch.setattr(tl, "_hopper", lambda device: True)
    assert not tl.available(torch.device("cuda"))
    monkeypatch.setattr(tl, "_importable", lambda: True)
    assert tl.available(torch.device("cuda"))


@pytest.mark.parametrize(
    ("batch", "head_blocks", "max_tokens", "want"),
    [
        (64, 2, 32768, 1),  # 128 CTAs on 132 SMs: one wave is 97% full
        (128, 1, 4096, 1),
        (128, 2, 1024, 1),  # 256 CTAs: two waves, 97%
        (8, 2, 3007, 8),  # 16 CTAs -> 128
        (1, 2, 32768, 64),  # 2 CTAs -> 128
        (1, 2, 300, 2),  # no split under 256 tokens
        (40, 2, 8192, 8),  # 80 CTAs (61%) -> 160 (61%) -> 320 (81%) -> 640 (97%): the first >= 85%
    ],
)
def test_split_count_fills_the_sms_in_whole_waves(monkeypatch, batch, head_blocks, max_tokens, want) -> None:
    monkeypatch.setattr(tl, "num_sms", lambda device: 132)
    got = tl.choose_num_splits(batch, head_blocks, max_tokens, torch.device("cuda"))
    assert got == want


def test_unsupported_dtypes_are_not_the_kernels() -> None:
    q = torch.zeros(1, 16, 576)
    assert not tl.supported(q, 512)  # float32
    assert tl.supported(q.to(torch.bfloat16), 512)
    assert not tl.supported(q.to(torch.bfloat16)[..., :516], 512)  # rope 4: not a 16-byte copy
    assert not tl.supported(q.to(torch.bfloat16)[..., :320], 256 + 8)  # d_v not a multiple of 128


@pytest.mark.parametrize(
    ("page", "want"),
    [
        (64, True),  # a FlashMLA block table: whole tiles by TMA, the seesaw schedule
        (128, True),
        (1, False),  # the engine's per-token table gathers with the three-role schedule
        (16, False),
    ],
)
def test_the_seesaw_schedule_runs_where_tiles_arrive_by_tma(page: int, want: bool) -> None:
    from runtime.gpu.kernels.mla_decode.tilelang_tiles import tiled

    assert tiled(page) is want


def test_a_page_table_reads_the_same_slots_as_the_per_token_table() -> None:
    from runtime.gpu.kernels.mla_decode.reference import mla_decode, page_table
    from runtime.gpu.kernels.mla_decode.testing import mla_case

    c = mla_case([130, 64, 1, 0], 16, torch.float32, "cpu", page_size=64, seed=3)
    q, pool, r2t, rows, lens, scale = c.args()[:6]
    table = page_table(r2t, 64)
    assert table.shape[1] == -(-r2t.shape[1] // 64)
    want, want_lse = mla_decode(q, pool, r2t, rows, lens, scale, return_lse=True)
    got, lse = mla_decode(q, pool, table, rows, lens, scale, return_lse=True, page_size=64)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lse, want_lse)


def test_the_contiguous_bench_layout_is_flash_mlas_arange_block_table() -> None:
    """`mla_case(shuffle_pages=False)`: rows take consecutive pages in row order (FlashMLA's benchmark
    input), and the per-token table addresses the same slots as the block table."""
    from runtime.gpu.kernels.mla_decode.testing import mla_case

    c = mla_case([130, 64, 1], 16, torch.float32, "cpu", page_size=64, seed=3, shuffle_pages=False)
    assert c.block_table.tolist() == [[1, 2, 3], [4, 0, 0], [5, 0, 0]]
    for b, n in enumerate([130, 64, 1]):
        pos = torch.arange(n)
        slots = c.block_table[b, pos // 64].long() * 64 + pos % 64
        assert torch.equal(c.req_to_token[c.rows[b], :n], slots)
    shuffled = mla_case([130, 64, 1], 16, torch.float32, "cpu", page_size=64, seed=3)
    assert shuffled.block_table.tolist() != c.block_table.tolist()


def test_the_block_table_view_of_a_case_attends_the_same_tokens() -> None:
    """The bench's block-table entry reads `block_table` through the case's `block_rows` (built once,
    so that a timed call launches the kernel alone): same output as the per-token table."""
    from runtime.gpu.kernels.mla_decode.reference import mla_decode
    from runtime.gpu.kernels.mla_decode.testing import mla_case

    c = mla_case([130, 64, 1, 0], 16, torch.float32, "cpu", page_size=64, seed=5)
    assert c.block_rows.tolist() == [0, 1, 2, 3]
    want = mla_decode(*c.args())
    got = mla_decode(c.q, c.pool, c.block_table.long(), c.block_rows, c.seq_lens, c.scale, page_size=64)
    torch.testing.assert_close(got, want, equal_nan=True)


def test_the_flash_mla_front_ends_metadata_is_built_once_per_batch(monkeypatch) -> None:
    """Our `get_mla_metadata` hands out a RowsMeta: the first call fills it, the next (another layer)
    reuses its tensors, and with s_q 1 the lengths are cache_seqlens itself (no copy kernel)."""
    from runtime.gpu.kernels.mla_decode import api
    from runtime.gpu.kernels.mla_decode.reference import mla_decode
    from runtime.gpu.kernels.mla_decode.testing import mla_case

    monkeypatch.setattr(api, "_impl", lambda device: "reference")
    c = mla_case([70, 5, 0], 16, torch.float32, "cpu", page_size=16, kv_lora_rank=64, rope_dim=16, seed=2)
    meta, splits = api.get_mla_metadata(c.cache_seqlens, 16, 1)
    assert isinstance(meta, api.RowsMeta) and splits is None
    q = c.q.unsqueeze(1)
    args = (q, c.k_cache(), c.block_table, c.cache_seqlens, 64, meta, splits)
    out, lse = api.flash_mla_with_kvcache(*args, softmax_scale=c.scale)
    rows = meta.rows
    assert meta.lens is c.cache_seqlens and rows.tolist() == [0, 1, 2]
    again, _ = api.flash_mla_with_kvcache(*args, softmax_scale=c.scale)
    assert meta.rows is rows
    want, want_lse = mla_decode(*c.args(), return_lse=True)
    torch.testing.assert_close(out[:, 0], want, equal_nan=True)
    torch.testing.assert_close(again, out, equal_nan=True)
    torch.testing.assert_close(lse[:, :, 0], want_lse)

"""The MLA decode benchmark (`benchmarks.kernels.mla_decode`) on the CPU: how it calls FlashMLA, with a
stand-in `flash_mla` module (the library itself needs a Hopper GPU)."""

from __future__ import annotations

import sys
import types

import torch

from benchmarks.kernels import mla_decode as bench
from runtime.gpu.kernels.mla_decode import reference
from runtime.gpu.kernels.mla_decode.testing import mla_case


def test_the_bench_times_flash_mla_with_its_metadata_built_once_per_case(monkeypatch) -> None:
    """`--impls flash_mla`, block-table entry: FlashMLA's scheduler metadata is built once per case
    (outside the timed call, as FlashMLA's own benchmark does) and rebuilt for the next case, and the
    call goes through the adapter with the case's block table. A stand-in `flash_mla` (the v1 API over
    the reference) plays the library."""
    built = []

    def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k):
        built.append((cache_seqlens, num_heads_per_head_k, num_heads_k))
        return torch.zeros(1, 8, dtype=torch.int32), torch.zeros(len(cache_seqlens) + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(q, k_cache, table, seqlens, d_v, meta, num_splits, softmax_scale, causal):
        b, _, _, dim = q.shape
        out, lse = reference.mla_decode(
            q[:, 0], k_cache.view(-1, dim), table.long(), torch.arange(b), seqlens.long(), softmax_scale,
            d_v, return_lse=True, page_size=k_cache.shape[1],
        )  # fmt: skip
        return out.unsqueeze(1), lse.unsqueeze(-1)

    fake = types.ModuleType("flash_mla")
    fake.get_mla_metadata, fake.flash_mla_with_kvcache = get_mla_metadata, flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    for seed, lens in enumerate(([130, 64, 1], [7, 200])):
        c = mla_case(lens, 16, torch.float32, "cpu", page_size=64, seed=seed)
        want, want_lse = reference.mla_decode(*c.args(), return_lse=True)
        for _ in range(2):
            got, lse = bench._run("flash_mla", "table", c)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(lse, want_lse)
        assert len(built) == seed + 1 and built[-1][0] is c.cache_seqlens and built[-1][1:] == (16, 1)

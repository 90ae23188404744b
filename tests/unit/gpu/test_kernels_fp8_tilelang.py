"""The TileLang FP8 block GEMM's host side, on the CPU: where it sits in the registry, when it is
available, and the tile configs and K splits it picks (the kernel itself is tested on CUDA in
tests/gpu/test_kernels_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.fp8_gemm import tilelang as tl

H200_SMS = 132


def test_tilelang_comes_after_deep_gemm_and_before_triton() -> None:
    names = [i.name for i in registry.implementations("fp8_block_gemm")]
    assert names == ["deep_gemm", "tilelang", "triton", "reference"]


def test_tilelang_needs_hopper_and_an_importable_tilelang(monkeypatch) -> None:
    impl = next(i for i in registry.implementations("fp8_block_gemm") if i.name == "tilelang")
    assert not impl.available(torch.device("cpu"))
    monkeypatch.setattr(registry, "is_hopper", lambda device: True)
    monkeypatch.setattr(registry, "tilelang_importable", lambda: False)
    assert not impl.available(torch.device("cuda"))
    monkeypatch.setattr(registry, "tilelang_importable", lambda: True)
    assert impl.available(torch.device("cuda"))


@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [
        (4096, 4096, 7168, "128x128s4t256k1"),  # the fastest of six tiles at every M = 4096 shape
        (4096, 7168, 2048, "128x128s4t256k1"),
        (4096, 2112, 7168, "128x128s4t256k1"),
        (64, 2112, 7168, "64x64s4t128k4"),  # 33 tiles x 4 splits of 14 groups
        (64, 7168, 2048, "64x64s4t128k1"),  # 112 tiles fill >= 80% unsplit
        (128, 7168, 2048, "64x128s4t128k1"),  # 112 wide tiles already fill
        (128, 4096, 7168, "64x64s4t128k1"),  # 64 wide tiles do not, 128 narrow ones do
        (1, 100, 384, "64x64s4t128k1"),  # 3 groups: no split leaves >= 4 per split
    ],
)
def test_choose_config(monkeypatch, m: int, n: int, k: int, want: str) -> None:
    monkeypatch.setattr(tl, "num_sms", lambda device: H200_SMS)
    assert tl.choose_config(m, n, k, torch.device("cuda")).label() == want


@pytest.mark.parametrize("groups", [3, 4, 8, 16, 56])
def test_splits_divide_the_groups_and_keep_four_per_split(groups: int) -> None:
    for tiles in (1, 7, 33, 200):
        split = tl.with_split(tl.TileConfig(64, 64, 4, 128), 64 * tiles, 64, 128 * groups, H200_SMS).split_k
        assert groups % split == 0 and (split == 1 or groups // split >= 4)


def test_unsupported_inputs_are_left_to_triton() -> None:
    fp8 = torch.float8_e4m3fn
    w = torch.zeros(64, 256, dtype=fp8)
    assert tl.supported(torch.zeros(4, 256, dtype=fp8), w, torch.bfloat16)
    assert not tl.supported(torch.zeros(4, 300, dtype=fp8), torch.zeros(64, 300, dtype=fp8), torch.bfloat16)
    assert not tl.supported(torch.zeros(4, 256, dtype=fp8), w, torch.float64)
    assert not tl.supported(torch.zeros(256, 4, dtype=fp8).T, w, torch.bfloat16)

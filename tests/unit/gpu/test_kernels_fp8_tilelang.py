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
    names = [i.name for i in registry.op("fp8_block_gemm").implementations()]
    assert names == ["deep_gemm", "tilelang", "triton", "reference"]


def test_tilelang_needs_hopper_and_an_importable_tilelang(monkeypatch) -> None:
    impl = registry.op("fp8_block_gemm").named("tilelang")
    assert not impl.available(torch.device("cpu"))
    monkeypatch.setattr(registry, "is_hopper", lambda device: True)
    monkeypatch.setattr(registry, "tilelang_importable", lambda: False)
    assert not impl.available(torch.device("cuda"))
    monkeypatch.setattr(registry, "tilelang_importable", lambda: True)
    assert impl.available(torch.device("cuda"))


@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [
        (4096, 4096, 7168, "128x128s4t256k1-pd"),  # the fastest tile at every M = 4096 shape
        (4096, 7168, 2048, "128x128s4t256k1-pd"),
        (4096, 2112, 7168, "128x128s4t256k1-pd"),
        (4096, 2112, 1408, "128x128s4t256k1"),  # 11 groups: "pd" takes them in pairs
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


@pytest.mark.parametrize(
    "label",
    ["128x128s4t256k1", "64x64s4t128k4", "128x128s4t256k1p16", "128x128s5t256k1-pd", "128x128s4t256k1p8-pd"],
)
def test_tile_labels_parse_back(label: str) -> None:
    assert tl.TileConfig.parse(label).label() == label


def test_precompile_keys_cover_every_row_count(monkeypatch) -> None:
    """The kernels compiled at startup are the ones any M picks (CONFIG_M stands for all of them); K not a
    multiple of 128 goes to Triton and compiles nothing."""
    monkeypatch.setattr(tl, "num_sms", lambda device: H200_SMS)
    dev = torch.device("cuda")
    shapes = {(2112, 7168), (7168, 2048), (576, 7168), (100, 300)}
    keys = tl.keys_for(shapes, torch.bfloat16, dev)
    assert {(n, k) for n, k, _, _ in keys} == shapes - {(100, 300)}
    assert all(out == "bfloat16" for _, _, out, _ in keys)
    for n, k in shapes - {(100, 300)}:
        for m in range(1, 400):
            assert (n, k, "bfloat16", tl.choose_config(m, n, k, dev)) in keys, (m, n, k)


@pytest.fixture
def compiled(monkeypatch) -> list[int]:
    """`tl._kernel` replaced by a recorder of the N of each call, failing for N = 13 (a tile nvcc
    rejects)."""
    calls = []

    def kernel(n, k, out, cfg):  # noqa: ANN001, ANN202
        calls.append(n)
        if n == 13:
            raise RuntimeError("nvcc: error\nptxas fatal: bad tile")
        return object()

    monkeypatch.setattr(tl, "_kernel", kernel)
    return calls


KEYS = [(13, 256, "bfloat16", tl.TileConfig()), (256, 256, "bfloat16", tl.TileConfig())]


def test_precompile_loads_what_compiled_and_reports_what_did_not(compiled: list[int]) -> None:
    lines = tl.precompile(KEYS, workers=0)
    assert lines[0].startswith("FAILED N=13 K=256 128x128s4t256k1: RuntimeError: ptxas fatal: bad tile")
    assert lines[1].startswith("N=256 K=256 128x128s4t256k1:")
    assert compiled == [13, 256, 256]  # compiled each once, loaded only the one that compiled


def test_nothing_is_precompiled_off_tilelang() -> None:
    from runtime.gpu.kernels.fp8_gemm.linear import precompile
    from runtime.gpu.layers.fp8_linear import Fp8Linear, weight_shapes

    model = torch.nn.Sequential(Fp8Linear(256, 384), torch.nn.Linear(4, 4), Fp8Linear(384, 256))
    assert weight_shapes(model) == {(384, 256), (256, 384)}
    assert precompile(weight_shapes(model), torch.bfloat16, torch.device("cpu")) == []


def test_precompile_marks_what_compiled_and_skips_it_next_time(compiled: list[int], tmp_path) -> None:
    """A second model load compiles nothing: marked kernels are only loaded (from TileLang's cache);
    a kernel that failed is not marked, so the next load tries it again."""
    first = tl.precompile(KEYS, workers=0, marks=tmp_path / "marks")
    assert first[0].startswith("FAILED") and compiled == [13, 256, 256]
    assert [p.name.endswith("256x256-bfloat16-128x128s4t256k1") for p in (tmp_path / "marks").iterdir()] == [
        True
    ]
    compiled.clear()
    second = tl.precompile(KEYS, workers=0, marks=tmp_path / "marks")
    assert second[0].startswith("FAILED") and second[1].endswith("compiled before")
    assert compiled == [13, 256]  # the failed one compiled again, the marked one loaded once

"""`fp8_linear` on the CPU: decode-sized calls (M <= 16 rows, K <= 4096) take the weight-only GEMM, the
rest quantize x and take the block GEMM; both against the float32 product with the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.fp8_gemm import reference
from runtime.gpu.kernels.fp8_gemm.linear import WEIGHT_ONLY_MAX_K, WEIGHT_ONLY_MAX_M, fp8_linear
from runtime.gpu.quant.fp8 import quantize


@pytest.fixture
def ops_called(monkeypatch) -> list[str]:
    """The registry ops `fp8_linear` asks for, in order (the implementations stay the real ones)."""
    called, get = [], registry.Op.get

    def spy(op, device):  # noqa: ANN001, ANN202
        called.append(op.name)
        return get(op, device)

    monkeypatch.setattr(registry.Op, "get", spy)
    return called


@pytest.mark.parametrize(
    ("rows", "k", "path"),
    [
        (1, 256, "weight-only"),
        (WEIGHT_ONLY_MAX_M, WEIGHT_ONLY_MAX_K, "weight-only"),
        (WEIGHT_ONLY_MAX_M + 1, 256, "w8a8"),
        (1, WEIGHT_ONLY_MAX_K + 128, "w8a8"),
    ],
)
def test_the_path_depends_on_rows_and_k(ops_called: list[str], rows: int, k: int, path: str) -> None:
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    wq, ws = quantize(torch.randn(200, k, generator=g) * 0.05, (128, 128))
    y = fp8_linear(x.view(1, rows, k), wq, ws)
    assert y.shape == (1, rows, 200)
    want = x @ reference.dequant_weight(wq, ws).T
    rel = ((y[0] - want).norm() / want.norm()).item()
    if path == "weight-only":
        assert ops_called == ["fp8_weight_gemm"] and rel < 1e-5  # float32 x, unquantized: exact up to sums
    else:
        assert ops_called == ["fp8_act_quant", "fp8_block_gemm"] and 1e-4 < rel < 0.06  # e4m3 x


@pytest.mark.parametrize(("rows", "path"), [(3, "weight-only"), (WEIGHT_ONLY_MAX_M + 1, "w8a8")])
def test_grouped_weights_read_their_own_columns_on_both_paths(
    ops_called: list[str], rows: int, path: str
) -> None:
    """A block-diagonal weight (DeepSeek-V4's o_a_proj, 2 groups of 128 rows over 256 columns each):
    the weight-only path in one launch, the W8A8 one a block GEMM per group; both equal the per-group
    products with the dequantized weight (W8A8: up to the activation rounding)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 256, generator=g)
    wq, ws = quantize(torch.randn(256, 256, generator=g) * 0.05, (128, 128))
    y = fp8_linear(x.flatten(1), wq, ws, groups=2)
    w = reference.dequant_weight(wq, ws)
    want = torch.cat([x[:, 0] @ w[:128].T, x[:, 1] @ w[128:].T], dim=1)
    rel = ((y - want).norm() / want.norm()).item()
    if path == "weight-only":
        assert ops_called == ["fp8_weight_gemm"] and rel < 1e-5
    else:
        assert ops_called == ["fp8_act_quant", "fp8_block_gemm"] and 1e-4 < rel < 0.06

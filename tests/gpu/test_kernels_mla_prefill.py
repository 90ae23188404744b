"""MLA prefill (op `mla_prefill`): every implementation the registry lists matches the PyTorch reference
on CUDA. DeepSeek shapes (d_qk 192 = 128 nope + 64 rope, d_v 128, h 16 and 128) in bf16: fresh prompts
up to 4K, rows on cached prefixes up to 4K, ragged batches mixing both with one-token rows, NaN between
rows (a read past a row's end poisons the output); fp16 and float32 on a ragged batch; the tiny test
models' dims (d_qk 24, d_v 16: the second q/k part and d_v padded to 16). `pytest -s` prints each case's
error ratio (<= 1 passes)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.kernels import registry
from runtime.gpu.kernels.mla_prefill.testing import prefill_case
from runtime.gpu.kernels.testing import TOLERANCE, close_ratio, impl_names, load_impl, load_reference

pytestmark = pytest.mark.gpu

OP = "mla_prefill"

SHAPES = [  # prefix lens, new-token lens, heads
    ([0], [1], 16),
    ([0], [4096], 128),
    ([0], [1000], 16),
    ([4096], [4096], 16),
    ([4000], [333], 128),
    ([1], [4095], 128),
    ([0, 17, 1000, 4096, 0, 63], [65, 2, 127, 500, 1, 64], 128),
    ([i * 61 for i in range(16)], [1 + (i % 3) * 40 for i in range(16)], 16),
]


def _check(name: str, c, dtype: torch.dtype) -> None:
    want = load_reference(OP)(*c.args())[c.row_tokens]
    got = load_impl(OP, name)(*c.args())[c.row_tokens]
    ratio = close_ratio(got, want, *TOLERANCE[dtype])
    print(f"\n  {name}: error {ratio:.3f}x tol")
    assert ratio <= 1.0


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize(
    "shape",
    SHAPES,
    ids=lambda s: f"b{len(s[0])}-maxprefix{max(s[0])}-maxnew{max(s[1])}-h{s[2]}",
)
def test_mla_prefill_matches_reference_bf16(name: str, shape: tuple) -> None:
    prefix, new, heads = shape
    c = prefill_case(prefix, new, heads, 192, 128, torch.bfloat16, "cuda", seed=heads + len(new))
    _check(name, c, torch.bfloat16)


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_mla_prefill_matches_reference_other_dtypes(name: str, dtype: torch.dtype) -> None:
    c = prefill_case([0, 300, 5], [200, 129, 1], 16, 192, 128, dtype, "cuda", seed=1, strided=True)
    _check(name, c, dtype)


@pytest.mark.parametrize("name", impl_names(OP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mla_prefill_at_the_tiny_test_models_dims(name: str, dtype: torch.dtype) -> None:
    c = prefill_case([0, 40, 3], [48, 9, 1], 4, 24, 16, dtype, "cuda", seed=2)
    _check(name, c, dtype)


def test_triton_is_the_cuda_choice() -> None:
    assert registry.op(OP).select("cuda").name == "triton"

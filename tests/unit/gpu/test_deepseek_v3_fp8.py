"""An FP8 block-quantized DeepSeek-V3 checkpoint (weights e4m3 + `weight_scale_inv`, sharded with an index
file, `quantization_config` as the released checkpoints) loads and matches the dequantized model."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.quant import fp8
from runtime.gpu.testing import (
    PlanBuilder,
    load_into_reference,
    reference_logits,
    save_tiny_deepseek_v3,
    seq_start,
    write_fp8_checkpoint,
)

BLOCK = (16, 16)  # the real 128 x 128 does not fit the tiny dims; 40-row kv_a_proj leaves a partial block


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    ref = save_tiny_deepseek_v3(root / "bf", seed=3)
    dequantized = write_fp8_checkpoint(root / "bf", root / "fp8", BLOCK)
    runner = ModelRunner(RunnerConfig(str(root / "fp8"), num_kv_slots=512, max_reqs=4, max_model_len=128))
    return ref, dequantized, runner


def test_quantize_dequantize_round_trip_is_within_fp8_precision():
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 70)  # columns of very different magnitude
    q, s = fp8.quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 5)
    err = (fp8.dequantize(q, s, BLOCK) - w).abs()
    bound = fp8.dequantize(torch.ones_like(q).float(), s, BLOCK) * fp8.FP8_MAX * 2**-4  # half an e4m3 ulp
    assert (err <= bound).all()


def test_fp8_checkpoint_matches_the_dequantized_reference(fp8_model):
    ref, dequantized, runner = fp8_model
    ids = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    original = reference_logits(ref, ids)
    load_into_reference(ref, dequantized)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder()
    runner.forward_logits(pb.plan([1], [0], [16], ids[:16], added=[seq_start(1, ids)]))
    for pos in range(16, 24):
        logits = runner.forward_logits(pb.plan([1], [pos], [1], [ids[pos]]))
        torch.testing.assert_close(logits[0], expected[pos], atol=1e-4, rtol=0)
    # and FP8 is close to the unquantized model (e4m3: 3 mantissa bits)
    rel = (expected - original).norm() / original.norm()
    assert rel < 0.1, rel


def test_fp8_weight_without_its_scale_is_an_error():
    q, _ = fp8.quantize(torch.randn(16, 16), BLOCK)
    with pytest.raises(ValueError, match="without a scale"):
        list(fp8.dequantize_stream(iter([("a.weight", q)]), BLOCK))

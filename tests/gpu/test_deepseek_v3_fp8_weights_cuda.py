"""DeepSeek-V2/V3 with FP8 block-scaled weights on CUDA (`--quantization auto` keeps a 128 x 128 FP8
checkpoint's; `fp8` quantizes dummy weights): the FP8 GEMM kernels (`fp8_act_quant`, `fp8_block_gemm`,
FP8 `fused_moe`) against transformers on the dequantized model and against the CPU references; decode
steps as CUDA graphs equal eager ones; a V2-Lite-shaped dummy model decodes in FP8 and bf16."""

from __future__ import annotations

import json
import time

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.layers.fp8_linear import Fp8Linear, MergedFp8Linear
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.quant import fp8
from runtime.gpu.testing import (
    PlanBuilder,
    assert_same_decode,
    decode_scenario,
    load_into_reference,
    prefill_then_decode,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    seq_start,
    write_fp8_checkpoint,
)

pytestmark = pytest.mark.gpu

BLOCK_DIMS = dict(intermediate_size=128, moe_intermediate_size=128)  # whole 128-row gate|up blocks
CONFIGS = {
    "v3": (save_tiny_deepseek_v3, dict()),
    "v2_lite_greedy": (save_tiny_deepseek_v2, dict(topk_method="greedy", q_lora_rank=None)),
}


def _fp8_checkpoint(tmp_path, name: str):
    build, overrides = CONFIGS[name]
    ref = build(tmp_path / "float", seed=7, **BLOCK_DIMS, **overrides)
    load_into_reference(ref, write_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", fp8.BLOCK))
    return tmp_path / "fp8", ref


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cuda_fp8_weights_logits_match_transformers_on_the_dequantized_model(tmp_path, name):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, ref = _fp8_checkpoint(tmp_path, name)
    cfg = dict(device="cuda", num_kv_slots=4096, max_reqs=8, max_model_len=256)
    runner = ModelRunner(RunnerConfig(str(path), **cfg))  # auto: an FP8 checkpoint on CUDA stays FP8
    layer = runner.model.model.layers[1]
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and layer.self_attn.o_proj.weight.dtype == fp8.FP8
    assert isinstance(runner.model.model.layers[0].mlp.gate_up_proj, MergedFp8Linear)
    assert layer.mlp.experts.gate_up_proj.dtype == fp8.FP8 and runner.graphs is not None
    seqs = torch.randint(3, 128, (3, 48), generator=torch.Generator().manual_seed(0)).tolist()
    ours = prefill_then_decode(runner, seqs, 40)  # bf16 activations, quantized to e4m3 per token, 128-group
    with torch.no_grad():
        expected = ref.cuda()(torch.tensor(seqs, device="cuda")).logits.float().cpu()[:, 39:]
    cos = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    assert cos.mean() > 0.99 and cos.min() > 0.95, cos
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85
    # float32 activations: the kernels against the CPU references. Both quantize x and H to e4m3, but an
    # element on a rounding boundary can land one e4m3 step apart (x / scale is not computed bit-equal),
    # so the bound is the activation quantization's own effect on the CPU (FP8 weights, quantized vs
    # float activations): the first H200 run measured the GPU/CPU mean difference at 1.6% (V3) and 3.9%
    # (V2-Lite) of the logits' spread. A wrong scale block or K group is many times that.
    cpu_cfg = RunnerConfig(str(path), quantization="fp8", **dict(cfg, device="cpu"))
    cpu = prefill_then_decode(ModelRunner(cpu_cfg), seqs, 40)
    unquantized = prefill_then_decode(
        ModelRunner(RunnerConfig(str(path), quantization="none", **dict(cfg, device="cpu"))), seqs, 40
    )
    gpu = prefill_then_decode(ModelRunner(RunnerConfig(str(path), dtype="float32", **cfg)), seqs, 40)
    err, noise = (gpu - cpu).abs(), (cpu - unquantized).abs()
    print(f"{name}: GPU vs CPU mean {err.mean():.4f}, activation quantization mean {noise.mean():.4f}")
    assert err.mean() < noise.mean(), (err.mean(), noise.mean())


def test_cuda_fp8_weights_decode_graph_replays_match_eager_steps(tmp_path):
    """float32 activations, so tokens fed back (use_last) agree too."""
    path, _ = _fp8_checkpoint(tmp_path, "v3")
    cfg = dict(device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=8, max_model_len=64)
    graphed = ModelRunner(RunnerConfig(str(path), quantization="fp8", **cfg))
    eager = ModelRunner(RunnerConfig(str(path), quantization="fp8", cuda_graph=False, **cfg))
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.model.model.layers[1].mlp.experts.down_proj.dtype == fp8.FP8
    assert_same_decode(decode_scenario(graphed), decode_scenario(eager), atol=1e-4, rtol=1e-4)


def test_v2_lite_shape_dummy_fp8_and_bf16_decode_step_times(tmp_path):
    from tests.gpu.test_deepseek_v3_cuda import V2_LITE_SHAPE

    (tmp_path / "config.json").write_text(json.dumps(V2_LITE_SHAPE))
    times = {}
    for quant in ("fp8", "none"):
        cfg = dict(device="cuda", load_format="dummy", num_kv_slots=70000, max_reqs=64, max_model_len=1024)
        runner = ModelRunner(RunnerConfig(str(tmp_path), quantization=quant, **cfg))
        experts = runner.model.model.layers[1].mlp.experts
        assert (experts.gate_up_proj.dtype == fp8.FP8) == (quant == "fp8") and runner.graphs is not None
        for batch in (1, 64):
            pb, rows, prompt = PlanBuilder(list(range(1, 70000))), list(range(1, batch + 1)), list(range(128))
            added = [seq_start(r, prompt) for r in rows]
            runner.execute(pb.plan(rows, [0] * batch, [128] * batch, prompt * batch, added=added))
            steps = []
            for i in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.execute(pb.plan(rows, [128 + i] * batch, [1] * batch, [], use_last=[True] * batch))
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t0)
            times[quant, batch] = sorted(steps[5:])[len(steps[5:]) // 2]
            print(f"V2-Lite shape, dummy, weights {quant}, decode batch {batch} (CUDA graph): "
                  f"{times[quant, batch] * 1e3:.2f} ms/step (context 128)")  # fmt: skip
        del runner
        torch.cuda.empty_cache()
    assert all(t < 0.05 for t in times.values()), times  # seconds

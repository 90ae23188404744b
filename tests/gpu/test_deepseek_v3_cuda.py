"""DeepSeek-V3 on CUDA (Triton MLA decode, fused MoE, decode steps as CUDA graphs): float32 matches
transformers almost exactly, bfloat16 within tolerance; graph replays equal eager steps; a
DeepSeek-V2-Lite-shaped model (MLA + 64 experts, dummy weights) runs decode at batch 1 and 64."""

from __future__ import annotations

import json
import time

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v3.attention_kernel import MLAKernelBackend
from runtime.gpu.testing import (
    YARN_ROPE,
    PlanBuilder,
    assert_same_decode,
    decode_scenario,
    prefill_then_decode,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    seq_start,
)

pytestmark = pytest.mark.gpu

CONFIGS = {  # name: (checkpoint builder, overrides)
    "v3": (save_tiny_deepseek_v3, dict()),
    "yarn_direct_q": (
        save_tiny_deepseek_v3,
        dict(rope_parameters=YARN_ROPE, q_lora_rank=None, first_k_dense_replace=2, num_hidden_layers=4),
    ),
    # DeepseekV2ForCausalLM: softmax routing within the best groups (moe_route's V2 path), no bias
    "v2_group_limited": (save_tiny_deepseek_v2, dict()),
    "v2_lite_greedy": (save_tiny_deepseek_v2, dict(topk_method="greedy", q_lora_rank=None)),
}
# DeepSeek-V2-Lite's shapes in the V3 architecture (V3 routing): 15.7B parameters.
V2_LITE_SHAPE = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=0,
    bos_token_id=100000,
    eos_token_id=100001,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_logits_match_transformers(tmp_path, name, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    build, overrides = CONFIGS[name]
    ref = build(tmp_path, seed=7, **overrides).cuda()
    cfg = RunnerConfig(
        str(tmp_path), device="cuda", dtype=dtype, num_kv_slots=4096, max_reqs=8, max_model_len=256
    )
    runner = ModelRunner(cfg)
    assert isinstance(runner.attn, MLAKernelBackend) and runner.graphs is not None
    ours, expected = _logits_vs_transformers(runner, ref, 48, 40)
    if dtype == "float32":
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)
    else:  # bf16 may flip a near-tied expert choice; logits stay close overall
        cos = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
        assert cos.mean() > 0.995 and cos.min() > 0.97
        assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def _logits_vs_transformers(runner, ref, length: int, split: int):
    """Three rows: prefill `split` tokens, then decode one token per step to `length` (CUDA graphs,
    `prefill_then_decode`); our logits and transformers' on the same sequences, float32 on the host."""
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, 128, (3, length), generator=g).tolist()
    ours = prefill_then_decode(runner, seqs, split)
    with torch.no_grad():
        expected = ref(torch.tensor(seqs, device="cuda")).logits.float().cpu()[:, split - 1 :]
    return ours, expected


def test_pages_of_64_decode_through_a_page_table(tmp_path):
    """bf16 with 64-token pages (shuffled): decode steps hand the kernel a page table, so on Hopper
    with TileLang whole tiles arrive by TMA (the seesaw schedule); rows of 100-160 tokens cover full
    and partial tiles; DeepSeek's latent width (512 + 64) so the TileLang kernel takes it. Logits as close
    to transformers as the per-token path's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = save_tiny_deepseek_v3(tmp_path, seed=7, kv_lora_rank=512, qk_rope_head_dim=64).cuda()
    cfg = RunnerConfig(
        str(tmp_path), device="cuda", dtype="bfloat16", num_kv_slots=4096, max_reqs=8, max_model_len=256,
        page_size=64,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    assert runner.graphs is not None
    ours, expected = _logits_vs_transformers(runner, ref, 160, 100)  # shuffled 64-token pages
    cos = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    assert cos.mean() > 0.995 and cos.min() > 0.97
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("page_size", [1, 64])
def test_fp8_latent_cache_decode_stays_near_transformers(tmp_path, page_size):
    """bf16 with --kv-cache-dtype fp8_e4m3: the latent pool in e4m3 (scale 1), upcast by the Triton
    `mla_decode` kernel (TileLang and FlashMLA hand e4m3 pools to it), CUDA-graph decode over per-token
    slots and 64-token pages. Logits stay near transformers' (bf16 throughout) within the rounding."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = save_tiny_deepseek_v3(tmp_path, seed=7, kv_lora_rank=512, qk_rope_head_dim=64).cuda()
    cfg = RunnerConfig(
        str(tmp_path), device="cuda", dtype="bfloat16", num_kv_slots=4096, max_reqs=8, max_model_len=256,
        page_size=page_size, kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    runner = ModelRunner(cfg)
    assert runner.graphs is not None and runner.kv_pool.kv[0].dtype == torch.float8_e4m3fn
    ours, expected = _logits_vs_transformers(runner, ref, 160, 100)
    cos = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
    print(f"\n  page {page_size}: cosine mean {cos.mean():.4f} min {cos.min():.4f}")
    assert cos.mean() > 0.99 and cos.min() > 0.95
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.85


def test_decode_graph_replays_match_eager_steps(tmp_path):
    """float32, so tokens fed back (use_last) agree too; bf16 graphs are checked against transformers."""
    save_tiny_deepseek_v3(tmp_path, seed=3)
    cfg = dict(device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=8, max_model_len=64)
    graphed = ModelRunner(RunnerConfig(str(tmp_path), **cfg))
    eager = ModelRunner(RunnerConfig(str(tmp_path), cuda_graph=False, **cfg))
    assert graphed.graphs is not None and eager.graphs is None
    assert_same_decode(decode_scenario(graphed), decode_scenario(eager), atol=1e-4, rtol=1e-4)


def test_v2_lite_shape_dummy_decode_step_times(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V2_LITE_SHAPE))
    runner = ModelRunner(
        RunnerConfig(
            str(tmp_path),
            device="cuda",
            load_format="dummy",
            num_kv_slots=70000,
            max_reqs=64,
            max_model_len=1024,
        )
    )
    assert runner.graphs is not None
    for batch, graphs in ((1, True), (1, False), (64, True), (64, False)):
        runner.graphs.enabled = graphs
        pb, rows = PlanBuilder(list(range(1, 70000))), list(range(1, batch + 1))
        prompt = list(range(10, 138))
        runner.execute(
            pb.plan(
                rows, [0] * batch, [128] * batch, prompt * batch, added=[seq_start(r, prompt) for r in rows]
            )
        )
        times = []
        for i in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.execute(pb.plan(rows, [128 + i] * batch, [1] * batch, [], use_last=[True] * batch))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step = sorted(times[5:])[len(times[5:]) // 2]
        mode = "CUDA graph" if graphs else "eager"
        print(
            f"V2-Lite shape, dummy bf16, decode batch {batch} ({mode}): {step * 1e3:.2f} ms/step (context 128)"
        )
        assert step < 5.0

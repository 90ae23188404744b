"""Our DeepSeek-V3 through the paged latent cache matches transformers' DeepseekV3ForCausalLM (float32), and
so does DeepseekV2ForCausalLM, which the same model serves with V2 routing (against transformers'
DeepseekV2ForCausalLM)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import (
    YARN_ROPE,
    PlanBuilder,
    reference_logits,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    seq_start,
    shuffled_slots,
)
from runtime.gpu.testing import random_prompt as prompt

TOL = 1e-4
CONFIGS = {  # name: (checkpoint builder, overrides)
    # q LoRA, interleaved rope, 1 dense + 2 MoE layers, 4 expert groups of 2 (top-2 groups, top-3 experts)
    "v3": (save_tiny_deepseek_v3, dict()),
    # YaRN with mscale (rope tables and softmax scale), direct q_proj, 2 dense layers, 2 groups
    "yarn_direct_q": (
        save_tiny_deepseek_v3,
        dict(
            rope_parameters=YARN_ROPE,
            q_lora_rank=None,
            first_k_dense_replace=2,
            num_hidden_layers=4,
            n_group=2,
            topk_group=1,
        ),
    ),
    # every layer MoE, one group, rotate-half rope, unnormalised top-k weights, 2 shared experts
    "flat_routing": (
        save_tiny_deepseek_v3,
        dict(
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
            norm_topk_prob=False,
            n_shared_experts=2,
            num_experts_per_tok=2,
        ),
    ),
    # V2 / V2.5: q LoRA, group-limited greedy (best 2 of 4 groups), YaRN with mscale, 1 dense + 2 MoE layers
    "v2": (save_tiny_deepseek_v2, dict(rope_parameters=YARN_ROPE)),
    # V2-Lite: direct q_proj, plain greedy top-k (n_group set but ignored, as in transformers), default
    # rope, 2 shared experts, weights times 1
    "v2_lite": (
        save_tiny_deepseek_v2,
        dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0, n_shared_experts=2),
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build, overrides = CONFIGS[request.param]
    ref = build(path, seed=7, **overrides)
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=1024, max_reqs=8, max_model_len=256))
    return ref, runner


def test_full_prefill_matches_reference_at_every_position(tiny):
    ref, runner = tiny
    ids = prompt(70, seed=1)  # past YaRN's original 32 positions
    pb = PlanBuilder(shuffled_slots(1))
    plan = pb.plan([1], [0], [70], ids, added=[seq_start(1, ids)])
    logits = runner.token_logits(plan)  # all positions, not only the sampled one
    torch.testing.assert_close(logits, reference_logits(ref, ids), atol=TOL, rtol=0)


def test_chunked_prefill_matches_reference(tiny):
    ref, runner = tiny
    ids = prompt(60, seed=2)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(2))
    cuts = [0, 17, 40, 60]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        added = [seq_start(2, ids)] if i == 0 else []
        logits = runner.forward_logits(pb.plan([2], [a], [b - a], ids[a:b], added=added))
        torch.testing.assert_close(logits[0], expected[b - 1], atol=TOL, rtol=0)


def test_token_by_token_decode_through_the_latent_cache(tiny):
    """Every step after the first is a decode: the absorbed form over shuffled latent slots."""
    ref, runner = tiny
    ids = prompt(30, seed=3)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(3))
    runner.forward_logits(pb.plan([3], [0], [1], ids[:1], added=[seq_start(3, ids)]))
    for pos in range(1, len(ids)):
        logits = runner.forward_logits(pb.plan([3], [pos], [1], [ids[pos]]))
        torch.testing.assert_close(logits[0], expected[pos], atol=TOL, rtol=0)


def test_mixed_batch_of_prefills_and_decodes_of_different_lengths(tiny):
    ref, runner = tiny
    a, b, c = prompt(30, 11), prompt(21, 12), prompt(9, 13)
    pb = PlanBuilder(shuffled_slots(4))
    runner.forward_logits(
        pb.plan([4, 5], [0, 0], [29, 20], a[:29] + b[:20], added=[seq_start(4, a), seq_start(5, b)])
    )
    plan = pb.plan([4, 6, 5], [29, 0, 20], [1, 9, 1], [a[29]] + c + [b[20]], added=[seq_start(6, c)])
    logits = runner.forward_logits(plan)
    expected = torch.stack([reference_logits(ref, s)[-1] for s in (a, c, b)])
    torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)

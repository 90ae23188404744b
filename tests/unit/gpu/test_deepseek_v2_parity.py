"""Our DeepSeek-V2 (V3's model with V2 routing) through the paged latent cache matches transformers'
DeepseekV2ForCausalLM (float32); its router matches transformers' V2 router and reads the released
V2 / V2-Lite configs as DeepSeek's own code does."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.layers.moe import TopkRouter
from runtime.gpu.model_runner import ModelRunner, RunnerConfig
from runtime.gpu.models import get_model_class
from runtime.gpu.models.deepseek_v3 import DeepseekV3ForCausalLM
from runtime.gpu.testing import (
    YARN_ROPE,
    PlanBuilder,
    reference_logits,
    save_tiny_deepseek_v2,
    seq_start,
    shuffled_slots,
    tiny_deepseek_v2_config,
)
from runtime.gpu.testing import random_prompt as prompt

TOL = 1e-4
CONFIGS = {
    # V2 / V2.5: q LoRA, group-limited greedy (best 2 of 4 groups), YaRN with mscale, 1 dense + 2 MoE layers
    "v2": dict(rope_parameters=YARN_ROPE),
    # V2-Lite: direct q_proj, plain greedy top-k (n_group set but ignored, as in transformers), default
    # rope, 2 shared experts, weights times 1
    "v2_lite": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0, n_shared_experts=2),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_deepseek_v2(path, seed=5, **CONFIGS[request.param])
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=1024, max_reqs=8, max_model_len=256))
    return ref, runner


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    assert diff < TOL, diff
    return diff


def test_full_prefill_matches_reference_at_every_position(tiny):
    ref, runner = tiny
    ids = prompt(70, seed=1)  # past YaRN's original 32 positions
    pb = PlanBuilder(shuffled_slots(1))
    plan = pb.plan([1], [0], [70], ids, added=[seq_start(1, ids)])
    batch, _, _ = runner._build_batch(plan)  # all positions, not only the sampled one
    runner._update_table(plan)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch))
    _max_diff(logits, reference_logits(ref, ids))


def test_chunked_prefill_matches_reference(tiny):
    ref, runner = tiny
    ids = prompt(60, seed=2)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(2))
    cuts = [0, 17, 40, 60]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        added = [seq_start(2, ids)] if i == 0 else []
        logits = runner.forward_logits(pb.plan([2], [a], [b - a], ids[a:b], added=added))
        _max_diff(logits[0], expected[b - 1])


def test_token_by_token_decode_through_the_latent_cache(tiny):
    """Every step after the first is a decode: the absorbed form over shuffled latent slots."""
    ref, runner = tiny
    ids = prompt(30, seed=3)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(3))
    runner.forward_logits(pb.plan([3], [0], [1], ids[:1], added=[seq_start(3, ids)]))
    for pos in range(1, len(ids)):
        logits = runner.forward_logits(pb.plan([3], [pos], [1], [ids[pos]]))
        _max_diff(logits[0], expected[pos])


def test_v2_is_served_by_the_v3_model_without_a_correction_bias(tiny):
    _, runner = tiny
    assert get_model_class(runner.model.config) is DeepseekV3ForCausalLM
    assert not [n for n, _ in runner.model.named_parameters() if "correction_bias" in n]


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_router_matches_transformers_v2_router(method):
    """Sharp router logits (weights of std 0.5) so group limits and the top-k cut both decide."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = tiny_deepseek_v2_config(
        n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4, topk_method=method
    )
    ref = DeepseekV2TopkRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(ref.weight, std=0.5)
    ours = TopkRouter(config)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(50, config.hidden_size)
    _, ref_w, ref_ids = ref(x)
    w, ids = ours(x)
    ref_ids, order = ref_ids.sort(-1)
    ids, our_order = ids.sort(-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.gather(1, our_order), ref_w.gather(1, order), atol=1e-6, rtol=0)


# Routing fields of the released config.json files (deepseek-ai/DeepSeek-V2, -V2.5: group-limited;
# -V2-Lite: greedy); none has `e_score_correction_bias` tensors.
RELEASED = {
    "V2": dict(topk_method="group_limited_greedy", n_group=8, topk_group=3, n_routed_experts=160,
               num_experts_per_tok=6, routed_scaling_factor=16.0),
    "V2-Lite": dict(topk_method="greedy", n_group=1, topk_group=1, n_routed_experts=64,
                    num_experts_per_tok=6, routed_scaling_factor=1.0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_router_reads_released_v2_configs(name):
    fields = RELEASED[name]
    config = tiny_deepseek_v2_config(scoring_func="softmax", norm_topk_prob=False, **fields)
    router = TopkRouter(config)
    assert (router.scoring, router.has_bias, router.norm_topk_prob) == ("softmax", False, False)
    assert (router.num_groups, router.topk_group) == (fields["n_group"], fields["topk_group"])
    assert (router.top_k, router.scaling) == (6, fields["routed_scaling_factor"])


def test_router_rejects_an_unknown_topk_method():
    with pytest.raises(ValueError, match="topk_method"):
        TopkRouter(tiny_deepseek_v2_config(topk_method="sparsemixer"))

"""DeepSeek-V2 is V3's model with V2 routing: the router matches transformers' V2 router and reads the
released V2 / V2-Lite configs as DeepSeek's own code does. Logit parity with transformers'
DeepseekV2ForCausalLM (prefill, chunked prefill, decode, mixed batches) runs in test_deepseek_v3_parity.py
with the V3 configs."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.layers.moe import TopkRouter
from runtime.gpu.models import get_model_class
from runtime.gpu.models.deepseek_v3.model import DeepseekV3ForCausalLM
from runtime.gpu.testing import assert_router_matches, tiny_deepseek_v2_config


def test_v2_is_served_by_the_v3_model_without_a_correction_bias():
    config = tiny_deepseek_v2_config()
    config.architectures = ["DeepseekV2ForCausalLM"]  # as in a released config.json
    assert get_model_class(config) is DeepseekV3ForCausalLM
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    assert not [n for n, _ in model.named_parameters() if "correction_bias" in n]


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
    assert_router_matches(ref, config)


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

"""MLA's absorbed decode equals the expanded form; the expert-sorted MoE and the router equal the
reference's per-expert loop and router on random inputs."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.layers.moe import RoutedExperts
from runtime.gpu.models.deepseek_v3.attention_ref import mla_absorbed, mla_expanded
from runtime.gpu.testing import assert_router_matches, tiny_deepseek_v3_config


@pytest.mark.parametrize(
    ("heads", "dn", "dr", "dv", "r", "seq"), [(4, 16, 8, 16, 32, 1), (3, 8, 4, 12, 24, 37)]
)
def test_absorbed_decode_equals_expanded_attention(heads, dn, dr, dv, r, seq):
    g = torch.Generator().manual_seed(seq)
    batch = 3
    lens = [seq, max(1, seq // 2), max(1, seq - 3)]
    q_nope = torch.randn(batch, heads, dn, generator=g, dtype=torch.float64)
    q_pe = torch.randn(batch, heads, dr, generator=g, dtype=torch.float64)
    latents = torch.randn(batch, seq, r + dr, generator=g, dtype=torch.float64)
    w_uk = torch.randn(heads, dn, r, generator=g, dtype=torch.float64) / r**0.5
    w_uv = torch.randn(heads, dv, r, generator=g, dtype=torch.float64) / r**0.5
    mask = (torch.arange(seq)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    scale = (dn + dr) ** -0.5
    absorbed = mla_absorbed(q_nope, q_pe, latents, w_uk, w_uv, scale, mask)
    for b, n in enumerate(lens):
        expanded = mla_expanded(q_nope[b : b + 1], q_pe[b : b + 1], latents[b, :n], w_uk, w_uv, scale)
        torch.testing.assert_close(absorbed[b], expanded[0], atol=1e-10, rtol=0)


def test_expanded_prefill_with_prefix_mask_equals_causal_attention_over_the_whole_row():
    g = torch.Generator().manual_seed(0)
    h, dn, dr, dv, r, n, prefix = 2, 8, 4, 8, 16, 12, 5
    q_nope, q_pe = torch.randn(n, h, dn, generator=g), torch.randn(n, h, dr, generator=g)
    latent = torch.randn(n, r + dr, generator=g)
    w_uk, w_uv = torch.randn(h, dn, r, generator=g), torch.randn(h, dv, r, generator=g)
    whole = mla_expanded(q_nope, q_pe, latent, w_uk, w_uv, 0.3, causal=True)
    mask = torch.arange(n)[None, :] <= (prefix + torch.arange(n - prefix))[:, None]
    tail = mla_expanded(q_nope[prefix:], q_pe[prefix:], latent, w_uk, w_uv, 0.3, mask=mask)
    torch.testing.assert_close(tail, whole[prefix:], atol=1e-5, rtol=0)


def test_router_matches_transformers_topk_router():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = tiny_deepseek_v3_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    ref = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    torch.nn.init.normal_(ref.weight, std=0.5)
    ref.e_score_correction_bias.uniform_(-0.3, 0.3)
    assert_router_matches(ref, config)


def test_expert_sorted_moe_equals_a_loop_over_tokens():
    g = torch.Generator().manual_seed(1)
    experts = RoutedExperts(num_experts=6, hidden=16, intermediate=8)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=g) * 0.3)
    x = torch.randn(20, 16, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(20)])
    ids[:, 0] = 2  # one expert gets every token, another (5 is rarely left out) maybe none
    weights = torch.rand(20, 3, generator=g)
    expected = torch.zeros_like(x)
    for t in range(20):
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=0)

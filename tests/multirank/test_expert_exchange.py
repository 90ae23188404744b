"""The expert-parallel exchange against the single-rank fused MoE (the reference op), on 2 and 4 CPU ranks
over gloo: each rank's tokens (one rank has none, as an idle DP rank) go to the ranks holding their
experts and come back weighted; the sum equals all experts run locally, with and without redundant
copies, in both modes (variable splits; fixed blocks, as CUDA graphs need), and the measured load counts
each routed (token, expert) pair once. Plus EPLB's placement rules."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.layers.expert_parallel import ExpertPlacement, rebalance
from runtime.gpu.testing.ranks import run_ranks

E, D, INTER, K = 8, 16, 32, 2


def _check_exchange(rank: int, world: int, redundant: int, mode: str, impl: str = "reference") -> None:
    from runtime.gpu import distributed
    from runtime.gpu.kernels.fused_moe.reference import fused_moe
    from runtime.gpu.layers.expert_parallel import ExpertParallelMoE
    from runtime.gpu.layers.moe import RoutedExperts

    g = torch.Generator().manual_seed(0)  # the same experts on every rank
    w13, w2 = torch.randn(E, 2 * INTER, D, generator=g), torch.randn(E, D, INTER, generator=g)
    placement = ExpertPlacement.contiguous(E, world, redundant)
    local = placement.local(rank)
    experts = RoutedExperts(len(local), D, INTER, logical=local)
    experts.gate_up_proj.data.copy_(w13[local])
    experts.down_proj.data.copy_(w2[local])
    t = 0 if rank == 1 else 5 + 3 * rank  # rank 1 idles
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(t, D, generator=g)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    )
    weights = torch.rand(t, K, generator=g)
    from runtime.gpu.kernels.moe_exchange import MOE_EXCHANGE

    if impl == "deep_ep":  # the DeepEP adapter over the CPU stand-in of deep_ep.Buffer
        from runtime.gpu.kernels.moe_exchange.deep_ep import use_buffer_class
        from runtime.gpu.testing.fake_deep_ep import FakeBuffer

        use_buffer_class(FakeBuffer)
        MOE_EXCHANGE.clear_cache()
    assert MOE_EXCHANGE.select(torch.device("cpu")).name == impl
    ep = ExpertParallelMoE(placement)
    ep.mode, ep.count_load = mode, True
    ep.step_tokens = max(0 if r == 1 else 5 + 3 * r for r in range(world))  # what DP ranks agree on
    out = ep(x, weights, ids, experts)
    torch.testing.assert_close(out, fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert ep.load.tolist() == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    total = distributed.all_reduce(ep.load.clone(), distributed.ep())
    assert int(total.sum()) == K * sum(0 if r == 1 else 5 + 3 * r for r in range(world))


@pytest.mark.parametrize(
    ("world", "redundant", "mode"),
    [(2, 0, "normal"), (2, 2, "normal"), (4, 4, "normal"), (2, 2, "low_latency"), (4, 0, "low_latency")],
)
def test_exchange_equals_local_experts(world, redundant, mode):
    run_ranks(_check_exchange, world, redundant, mode)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_deep_ep_adapter_over_a_cpu_stand_in_equals_local_experts(mode):
    """DeepEP's normal and low-latency kernels through the op registry, `deep_ep.Buffer` replaced by a
    gloo stand-in with its documented results (runtime/gpu/testing/fake_deep_ep.py)."""
    run_ranks(_check_exchange, 2, 2, mode, "deep_ep")


def test_rebalance_copies_hot_experts_and_evens_rank_load():
    load = [100, 1, 1, 1, 1, 1, 1, 50]
    p = rebalance(load, ep_size=2, num_slots=10)
    copies = p.copies()
    assert len(copies[0]) == 2 and len(copies[7]) == 2 and all(len(c) == 1 for c in copies[1:7])
    per_rank = [sum(load[e] / len(copies[e]) for e in p.local(r)) for r in range(2)]
    assert abs(per_rank[0] - per_rank[1]) <= 1.0
    assert ExpertPlacement.from_json(p.to_json()) == p


def test_a_placement_must_hold_every_expert_once_per_rank():
    with pytest.raises(ValueError, match="at least once"):
        ExpertPlacement(4, 2, (0, 1, 2, 2))
    with pytest.raises(ValueError, match="twice"):
        ExpertPlacement(3, 2, (0, 0, 1, 2))

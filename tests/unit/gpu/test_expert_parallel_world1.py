"""The expert-parallel path at world size 1 (`--moe-a2a-backend all_to_all`): tiny DeepSeek-V3 and V4
decode the same greedy tokens with logits within float32 rounding of the plain fused MoE, in both
exchange modes (the low-latency mode is the one CUDA graphs capture). Also Llama's parallel layers at
tensor-parallel size 1 are the plain ones (the same logits as transformers is checked elsewhere)."""

from __future__ import annotations

import pytest

from runtime.config import RunnerConfig
from runtime.gpu.layers.expert_parallel import ExpertParallelMoE
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import (
    assert_same_decode,
    decode_scenario,
    save_tiny_deepseek_v3,
    save_tiny_deepseek_v4,
)

SAVERS = {"v3": save_tiny_deepseek_v3, "v4": save_tiny_deepseek_v4}


@pytest.mark.parametrize("family", ["v3", "v4"])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_ep_path_on_one_rank_decodes_as_the_plain_moe(tmp_path, family, mode):
    SAVERS[family](tmp_path, seed=3)
    cfg = dict(num_kv_slots=512, max_reqs=4, max_model_len=128, page_size=8)
    plain = ModelRunner(RunnerConfig(str(tmp_path), **cfg))
    ep = ModelRunner(RunnerConfig(str(tmp_path), moe_a2a_backend="all_to_all", **cfg))
    exchanges = [m for m in ep.model.modules() if isinstance(m, ExpertParallelMoE)]
    assert exchanges and not any(isinstance(m, ExpertParallelMoE) for m in plain.model.modules())
    for m in exchanges:
        m.mode, m.count_load = mode, True
    assert_same_decode(decode_scenario(ep), decode_scenario(plain), atol=1e-4, rtol=1e-4)
    assert all(int(m.load.sum()) > 0 for m in exchanges)  # every MoE layer routed through the exchange


def test_graphed_steps_exchange_in_fixed_blocks_past_the_low_latency_size(monkeypatch):
    """A verify graph's bucket x (K + 1) tokens may pass LOW_LATENCY_MAX_TOKENS; capture bakes the mode
    in and the normal exchange reads its counts on the host, so a graphed step takes fixed blocks at any
    size (and gives the normal exchange's sums)."""
    import torch

    from runtime.gpu.layers.expert_parallel import LOW_LATENCY_MAX_TOKENS, ExpertPlacement, graphed

    g = torch.Generator().manual_seed(0)
    t, k, experts_n, d = LOW_LATENCY_MAX_TOKENS + 64, 2, 4, 8
    x = torch.randn(t, d, generator=g)
    weights = torch.rand(t, k, generator=g)
    ids = torch.stack([torch.randperm(experts_n, generator=g)[:k] for _ in range(t)])
    scale = torch.arange(1, experts_n + 1, dtype=torch.float32)

    def experts(rows, w, local):  # noqa: ANN001, ANN202 - expert e scales its rows by e + 1
        return rows * w * scale[local]

    m = ExpertParallelMoE(ExpertPlacement.contiguous(experts_n, 1))
    want = m(x, weights, ids, experts)  # eager, on the CPU: the normal exchange
    host_reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: host_reads.append(1) or tolist(self))
    with graphed([m]):
        assert m.graphed
        got = m(x, weights, ids, experts)
    assert not m.graphed and not host_reads  # fixed blocks: no counts read on the host
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    m(x, weights, ids, experts)
    assert host_reads, "an eager step on the CPU takes the normal exchange"

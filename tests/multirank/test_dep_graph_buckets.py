"""DP ranks with expert parallelism agree on one graph and one batch bucket before each step
(runtime/gpu/lockstep.py): a captured graph keeps the exchange's block size of its bucket, so ranks with
different batch sizes must replay the same bucket, an idle rank must size its idle step's exchange alike,
and a step where any rank runs eagerly (a prefill) runs eagerly everywhere.

On 2 CPU ranks over gloo, each rank's runner takes the padded static-buffer path (the graphs' path, run
eagerly: it sizes the exchanges by its bucket, as capture bakes in) with the exchanges pinned to fixed
blocks (what CUDA graphs capture), and a tiny DeepSeek-V3's logits on every rank equal a single-rank
runner's on the same plans, through steps of unequal batches, an idle rank and a mixed step. The
control: ranks that replay their own buckets (what each rank did before the agreement) send blocks of
different sizes, and the exchange fails."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from runtime.gpu.testing.ranks import run_ranks

MAX_BS = 8
# per step, each rank's rows (decode: one token each), None: the rank has no plan; "prefill" rows start
STEPS = [
    ({1: "prefill", 2: "prefill", 3: "prefill"}, {1: "prefill"}),
    ([1, 2, 3], [1]),  # buckets 4 and 1: both replay 4
    ([1, 2, 3], None),  # rank 1 idle: its idle step's blocks are bucket 4's
    ([1, 2], {1: "decode", 2: "prefill"}),  # rank 1 mixed: every rank eager
    ([1, 2, 3], [1, 2]),  # buckets 4 and 2: both replay 4
    (None, [1, 2]),  # rank 0 idle
]
WANT = [("eager", 0), ("decode", 4), ("decode", 4), ("eager", 0), ("decode", 4), ("decode", 2)]


def _lockstep_decode(rank: int, world: int, addr: str, path: str, agree_rows: bool = True) -> None:
    from runtime.config import RunnerConfig
    from runtime.gpu import lockstep
    from runtime.gpu.cuda_graph import StepGraph
    from runtime.gpu.layers.expert_parallel import ExpertParallelMoE
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing import PlanBuilder, seq_start

    cfg = RunnerConfig(path, num_kv_slots=1024, max_reqs=MAX_BS, max_model_len=64, cpu_threads=1)
    alone = ModelRunner(cfg)  # world 1: every expert local
    ranked = ModelRunner(
        msgspec.structs.replace(cfg, rank=rank, world_size=world, ep_size=world, dist_init_addr=addr)
    )
    ranked.graphs = ranked.make_graphs(MAX_BS, capture=False)
    exchanges = [m for m in ranked.model.modules() if isinstance(m, ExpertParallelMoE)]
    assert exchanges
    for m in exchanges:
        m.mode = "low_latency"
    g = torch.Generator().manual_seed(10 + rank)
    vocab = alone.vocab_size
    builders = PlanBuilder(), PlanBuilder()
    lens: dict[int, int] = {}

    def plan_for(rows):  # noqa: ANN001, ANN202 - the same plan for both runners' builders
        if rows is None:
            return None, None
        rows = dict.fromkeys(rows, "decode") if isinstance(rows, list) else rows
        prefix, extend, ids, added = [], [], [], []
        for r, what in rows.items():
            n = int(torch.randint(4, 10, (1,), generator=g)) if what == "prefill" else 1
            new = torch.randint(3, vocab, (n,), generator=g).tolist()
            prefix.append(0 if what == "prefill" else lens[r])
            extend.append(n)
            ids += new
            if what == "prefill":
                added.append(seq_start(r, new))
            lens[r] = prefix[-1] + n
        return tuple(b.plan(list(rows), prefix, extend, ids, added=added) for b in builders)

    for i, steps in enumerate(STEPS):
        plans = plan_for(steps[rank])
        plan, twin = plans
        agreed = lockstep.agree(ranked, plan, stopping=False)
        assert agreed.state == 1
        if not agree_rows:  # the control: each rank its own bucket
            agreed = dataclasses.replace(agreed, rows=len(plan.rows) if plan else 0)
        lockstep.prepare(ranked, plan, agreed)
        kind, bs = WANT[i]
        assert agreed.graph == {"eager": StepGraph.EAGER, "decode": StepGraph.DECODE}[kind], f"step {i}"
        assert ranked.graphs.agreed_bs == bs or not agree_rows, f"step {i}"
        if plan is None:
            continue
        got = ranked.forward_logits(plan)
        want = alone.forward_logits(twin)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {rank} step {i}")
    agreed = lockstep.agree(ranked, None, stopping=rank == 1)
    assert agreed.state == 2


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    from runtime.gpu.testing import save_tiny_deepseek_v3

    path = tmp_path_factory.mktemp("tiny-v3")
    save_tiny_deepseek_v3(path)
    return str(path)


def test_dp_ranks_replay_one_agreed_bucket_and_decode_as_one_rank(tiny_v3):
    run_ranks(_lockstep_decode, 2, tiny_v3, join=False, timeout=300.0)


def test_ranks_replaying_their_own_buckets_fail_the_exchange(tiny_v3):
    with pytest.raises(AssertionError, match="rank"):
        run_ranks(_lockstep_decode, 2, tiny_v3, False, join=False, timeout=120.0)

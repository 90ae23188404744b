"""DP ranks with expert parallelism agree on one graph and one batch bucket before each step
(runtime/gpu/lockstep.py): a captured graph keeps the exchange's block size of its bucket, so ranks with
different batch sizes must replay the same bucket, an idle rank must size its idle step's exchange alike,
and a step where any rank runs eagerly (a prefill) runs eagerly everywhere.

On 2 CPU ranks over gloo, each rank's runner takes the padded static-buffer path (the graphs' path, run
eagerly: it sizes the exchanges by its bucket and takes fixed blocks, as capture bakes in; eager steps
take the normal exchange), and a tiny DeepSeek-V3's logits on every rank equal a single-rank
runner's on the same plans, through steps of unequal batches, an idle rank and a mixed step; and a tiny
DeepSeek-V4's verify steps (the n-gram runner's verify graphs, 4 places a row) likewise, beside a rank
whose plain decode step makes the step eager everywhere. The
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
    assert any(isinstance(m, ExpertParallelMoE) for m in ranked.model.modules())
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


# per step, each rank's (kind, rows); kinds: prefill, verify (3 drafts a row), decode; None: no plan
VERIFY_STEPS = [
    (("prefill", [1, 2, 3]), ("prefill", [1])),
    (("verify", [1, 2, 3]), ("verify", [1])),  # both replay the verify graph of 4 rows (16 places)
    (("verify", [1, 2, 3]), None),  # rank 1 idle: its idle step's blocks are 16 tokens'
    (("decode", [1, 2]), ("verify", [1])),  # a decode graph beside a verify graph: every rank eager
    (("verify", [1, 2]), ("verify", [1])),  # both replay 2 rows
]
VERIFY_WANT = [("eager", 0), ("verify", 4), ("verify", 4), ("eager", 0), ("verify", 2)]


def _lockstep_verify(rank: int, world: int, addr: str, path: str) -> None:
    from runtime.config import RunnerConfig
    from runtime.gpu import lockstep
    from runtime.gpu.cuda_graph import StepGraph
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing.plans import PagedPlanBuilder, random_prompt, seq_start

    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}
    cfg = RunnerConfig(path, num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1, **spec)
    alone = ModelRunner(cfg)  # world 1, eager
    ranked = ModelRunner(
        msgspec.structs.replace(cfg, rank=rank, world_size=world, ep_size=world, dist_init_addr=addr)
    )
    ranked.graphs = ranked.make_graphs(4, capture=False)
    assert ranked.graphs.q_len == 4
    vocab = alone.vocab_size
    builders = {id(r): PagedPlanBuilder(8, r.kv_pool.num_slots, seed=3) for r in (alone, ranked)}
    g = torch.Generator().manual_seed(20 + rank)
    seqs: dict[int, list[int]] = {}  # tokens whose KV is written
    last: dict[int, int] = {}  # each row's next token (not yet fed)

    def plan_of(runner, kind, rows, blocks):  # noqa: ANN001, ANN202
        pb = builders[id(runner)]
        if kind == "prefill":
            ids = [t for r in rows for t in blocks[r]]
            added = [seq_start(r, blocks[r]) for r in rows]
            return pb.plan(rows, [0] * len(rows), [len(blocks[r]) for r in rows], ids, added=added)
        prefix = [len(seqs[r]) for r in rows]
        if kind == "decode":
            return pb.plan(rows, prefix, [1] * len(rows), [last[r] for r in rows])
        for r in rows:  # the block each row verifies, through the `fed` table as a drafter leaves it
            runner.tables.fed[r, :4] = torch.tensor(blocks[r])
        return pb.plan(
            rows, prefix, [4] * len(rows), [], use_last=[True] * len(rows), draft_lens=[3] * len(rows)
        )

    for i, steps in enumerate(VERIFY_STEPS):
        mine = steps[rank]
        plan = twin = None
        if mine is not None:
            kind, rows = mine
            if kind == "prefill":
                blocks = {r: random_prompt(5 + 4 * r, 30 + rank * 10 + r, vocab) for r in rows}
            elif kind == "verify":
                blocks = {r: [last[r]] + torch.randint(3, vocab, (3,), generator=g).tolist() for r in rows}
            else:
                blocks = {r: [last[r]] for r in rows}
            plan, twin = plan_of(ranked, kind, rows, blocks), plan_of(alone, kind, rows, blocks)
        agreed = lockstep.agree(ranked, plan, stopping=False)
        lockstep.prepare(ranked, plan, agreed)
        kind_want, bs = VERIFY_WANT[i]
        assert agreed.graph == {"eager": StepGraph.EAGER, "verify": StepGraph.VERIFY}[kind_want], f"step {i}"
        assert ranked.graphs.agreed_bs == bs, f"step {i}"
        if plan is None:
            continue
        got = ranked.forward_logits(plan)
        want = alone.forward_logits(twin)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0, msg=f"rank {rank} step {i}")
        start = 0
        for r in rows:  # every position kept: the next step starts after the whole block
            seqs[r] = (seqs.get(r, []) if kind != "prefill" else []) + blocks[r]
            start += len(blocks[r]) if kind != "prefill" else 1
            last[r] = int(want[start - 1].argmax())
    assert lockstep.agree(ranked, None, stopping=rank == 0).state == 2


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


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    from runtime.gpu.testing import save_tiny_deepseek_v4

    path = tmp_path_factory.mktemp("tiny-v4")
    save_tiny_deepseek_v4(path, seed=7)
    return str(path)


def test_dp_ranks_replay_one_agreed_verify_bucket_and_verify_as_one_rank(tiny_v4):
    run_ranks(_lockstep_verify, 2, tiny_v4, join=False, timeout=300.0)

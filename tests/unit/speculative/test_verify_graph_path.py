"""Verify steps through the graph path (static buffers, padded batch buckets, q_len token places per
row with padding places for rows of fewer drafts), and the drafter's lookup on its padded graph
buffers, give plain decoding's tokens. On the CPU the path runs
eagerly over the same buffers with the PyTorch backend's masked multi-query decode; the Triton kernel's
q_len > 1 tiles are checked in tests/unit/gpu/test_kernels_interpret.py, real graph replays in
tests/gpu/test_speculative_cuda.py. DeepSeek-V4: the batched path (attention_decode.py) with q_len
places per row, blocks that close compressor windows and rejected drafts rolled back (`save_blocks` /
`restore_rejected` around the verify graph). Greedy rows planned ahead of their previous verify step's
counts (`StepPlan.assume_accepted`) are moved back inside the graphs, from the device's rejected counts."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import save_tiny_deepseek_v3, save_tiny_deepseek_v4, save_tiny_llama
from tests.unit.speculative.test_lossless import MAX_MODEL_LEN, SLOTS, batch, first_difference
from tests.unit.speculative.test_lossless import run as run_plain

FAMILIES = {
    "llama": lambda path: save_tiny_llama(path, num_key_value_heads=2),
    "deepseek_v3": save_tiny_deepseek_v3,  # MLA: the absorbed multi-query decode
    "deepseek_v4": save_tiny_deepseek_v4,  # window 8, CSA rate 4, HCA rate 8
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    return request.param, str(path)


def _runner(tiny: tuple[str, str], **spec) -> ModelRunner:
    family, path = tiny
    # V4: exact replay, so a prefix hit rebuilds the ring and tails from position 0 (as test_v4.py)
    v4 = {"swa_replay_exact": True} if family == "deepseek_v4" else {}
    cfg = RunnerConfig(
        path, num_kv_slots=SLOTS, max_reqs=8, max_model_len=MAX_MODEL_LEN, cpu_threads=1, **v4, **spec
    )
    return ModelRunner(cfg)


def run(runner: ModelRunner, reqs: list, **overrides):
    """V4's pages hold whole compressor windows (rates 4 and 8: the runner's page size is 8)."""
    return run_plain(runner, reqs, page_size=runner.page_size, **overrides)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_verify_steps_on_the_graph_path_equal_plain_decoding(tiny, sampled):
    plain = _runner(tiny)
    spec = _runner(tiny, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    spec.graphs = spec.make_graphs(8, capture=False)  # buckets 1, 2, 4, 8: 3 rows pad to 4, 5 to 8
    assert spec.graphs.q_len == 4
    spec.spec.capture_observe(spec.graphs.buckets, capture=False)  # the n-gram lookup on padded buffers too
    assert spec.spec.observe_graphs is not None
    used = []
    run_verify = spec.graphs.run_verify

    def counted(plan):
        used.append((len(plan.rows), list(plan.draft_lens), any(plan.assume_accepted)))
        return run_verify(plan)

    spec.graphs.run_verify = counted
    reqs = batch(sampled)
    want = run(plain, reqs).tokens
    got = run(spec, reqs)
    diff = {r.rid: first_difference(got.tokens[r.rid], want[r.rid]) for r in reqs}
    assert not {rid: i for rid, i in diff.items() if i is not None}
    # the graph path ran verify steps, padded batches and rows of fewer drafts (padding places) among them
    assert used, "no verify step took the graph path"
    assert any(min(k) < 3 for _, k, _ in used), used
    # (padded batches for certain where seeded rows wait for their verify steps: greedy rows planned
    # ahead keep the batch full, down to where requests finish)
    assert not sampled or any(n not in (1, 2, 4, 8) for n, _, _ in used), used
    # greedy rows were moved back on the device (test_plan_ahead.py checks the plain decode graphs too)
    assert any(a for *_, a in used) == (not sampled), used


def test_the_lookup_on_padded_graph_buffers_drafts_what_the_plain_lookup_drafts(tiny):
    """Same requests, same drafts: the speculation counters agree with and without the observe graphs
    (wrong drafts would stay lossless, only less accepted: this is what catches them)."""
    stats = []
    for graphed in (False, True):
        spec = _runner(tiny, speculative_algorithm="ngram", speculative_num_draft_tokens=3)
        if graphed:
            spec.spec.capture_observe([1, 2, 4, 8], capture=False)
        s = run(spec, batch(False)).stats.spec
        stats.append((s.steps, s.drafted, s.accepted, list(s.lengths)))
    assert stats[0] == stats[1] and stats[0][2] > 0, stats


# hidden-state drafters: their `capture` runs inside the decode and verify graphs
HIDDEN_STATE = [
    ("mtp", "deepseek_v3"),
    ("mtp", "deepseek_v4"),  # the MTP block reads the last layer's tapped streams
    ("dspark", "llama"),
    ("dspark", "deepseek_v4"),  # context features from tapped layers (hyper-connection streams)
    ("draft-model", "llama"),  # the target as its own draft: every token fed to it too
]


def _drafter_state(runner: ModelRunner) -> list:
    """What a hidden-state drafter keeps per KV slot, less the padding slot 0 (graph padding writes it)."""
    d = runner.spec.drafter
    if hasattr(d, "hidden"):  # MTP
        kept = [d.hidden]
    elif hasattr(d, "ctx_k"):  # DSpark
        kept = [*d.ctx_k, *d.ctx_v]
    else:  # the draft model's own KV, at the target's slots
        kept = [t[: runner.kv_pool.num_slots] for t in (*d.pool.k, *d.pool.v)]
    return [t[1:] for t in kept]


@pytest.mark.parametrize(("algorithm", "family"), HIDDEN_STATE, ids=[f"{a}-{f}" for a, f in HIDDEN_STATE])
def test_hidden_state_drafters_on_the_graph_path_keep_what_eager_steps_keep(tmp_path, algorithm, family):
    """MTP, DSpark and the draft model follow every target forward (its hidden states, tapped layers,
    tokens): on the graph path the decode and verify graphs hand them over. Same requests (every draft verified: the fixed policy) give plain
    decoding's tokens, the eager run's speculation counters, and the same kept state in every KV slot;
    both draft on the device, so with overlap greedy rows are planned ahead of their verify step's
    counts and moved back inside the graphs (MTP's entries too)."""
    if algorithm == "mtp":
        saver = save_tiny_deepseek_v3 if family == "deepseek_v3" else save_tiny_deepseek_v4
        saver(tmp_path, mtp_layers=1)
    else:
        FAMILIES[family](tmp_path)
    tiny = (family, str(tmp_path))
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    if algorithm == "draft-model":
        spec["speculative_draft_model_path"] = str(tmp_path)
    reqs = batch(False, n=6, max_new=24)
    want = run(_runner(tiny), reqs).tokens
    eager = _runner(tiny, **spec)
    graphed = _runner(tiny, **spec)
    graphed.graphs = graphed.make_graphs(8, capture=False)
    assert graphed.graphs.q_len == 4 and graphed.graphs.hidden_sink is not None
    graphed.spec.capture_observe(graphed.graphs.buckets, capture=False)
    used = {"decode": 0, "verify": 0}
    for kind, name in (("decode", "run"), ("verify", "run_verify")):
        original = getattr(graphed.graphs, name)

        def counted(plan, kind=kind, original=original):  # noqa: ANN001, ANN202
            used[kind] += 1
            return original(plan)

        setattr(graphed.graphs, name, counted)
    # overlap off: the same plans on both paths (eager CPU steps may plan any drafter's rows ahead)
    results = [run(r, reqs, speculative_draft_policy="fixed", disable_overlap=True) for r in (eager, graphed)]
    kept = [[t.clone() for t in _drafter_state(r)] for r in (eager, graphed)]
    # overlap on: rows planned ahead on the graph path (both draft on the device)
    results.append(run(graphed, reqs, speculative_draft_policy="fixed"))
    for got in results:
        assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}
    assert used["verify"] > 0 and used["decode"] > 0, used
    e, g, overlapped = (r.stats.spec for r in results)
    assert (e.steps, e.drafted, e.accepted) == (g.steps, g.drafted, g.accepted) and g.drafted > 0
    assert overlapped.ahead_rows > 0, overlapped
    for a, b in zip(*kept, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)

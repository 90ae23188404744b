"""Speculative decoding on CUDA: verify steps replay their own CUDA graphs (the decode kernel with
q_len = 4 query tokens per row; DeepSeek-V4: its batched path, rejected drafts rolled back around the
replay), plain decode steps theirs, mixed steps run eagerly; greedy outputs equal plain decoding's
through the real scheduler, float32. With overlap on, rows are planned into the step after their verify
step before its counts reach the host, and the verify graphs move them back on the device
(`StepPlan.assume_accepted`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from runtime.actors.scheduler.testing import run_scheduler
from runtime.config import RunnerConfig, ServerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import save_tiny_deepseek_v3, save_tiny_deepseek_v4, save_tiny_llama

pytestmark = pytest.mark.gpu

SAVE = {"llama": save_tiny_llama, "deepseek_v3": save_tiny_deepseek_v3, "deepseek_v4": save_tiny_deepseek_v4}


@pytest.mark.parametrize("family", sorted(SAVE))
def test_greedy_outputs_equal_plain_decoding_on_cuda(tmp_path, family):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "speculative"))
    from test_lossless import batch  # the CPU test's requests (repetitive motifs)

    torch.backends.cuda.matmul.allow_tf32 = False
    SAVE[family](tmp_path)
    # V4: exact replay, so a prefix hit rebuilds the ring and tails from position 0 (rejected drafts are
    # rolled back around the verify graphs)
    v4 = {"swa_replay_exact": True} if family == "deepseek_v4" else {}

    def runner(**spec) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(tmp_path), device="cuda", dtype="float32", num_kv_slots=4096,
                                        max_reqs=8, max_model_len=256, **v4, **spec))  # fmt: skip

    plain, spec = runner(), runner(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    assert spec.graphs is not None and spec.graphs.verify_graphs and spec.graphs.q_len == 4
    assert spec.spec.observe_graphs is not None and spec.spec.observe_graphs.graphs  # the n-gram lookup
    assert spec.verify_ahead
    replays = []
    run_verify = spec.graphs.run_verify
    spec.graphs.run_verify = lambda plan: replays.append(any(plan.assume_accepted)) or run_verify(plan)
    reqs = batch(False)
    cfg = ServerConfig(
        device="cuda",
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=2048,
        page_size=spec.page_size,  # V4's pages hold whole compressor windows
    )
    want, _ = asyncio.run(run_scheduler(cfg, reqs, runner=plain, max_model_len=256))
    got, _ = asyncio.run(run_scheduler(cfg, reqs, runner=spec, max_model_len=256))
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want.tokens[r.rid] for r in reqs}
    assert got.stats.spec.accepted > 0
    assert replays, "no verify step replayed a graph"
    assert any(replays) and got.stats.spec.ahead_rows > 0, "no verify graph moved a row planned ahead"


def test_rows_planned_ahead_are_moved_back_inside_the_captured_graphs(tmp_path):
    """The CPU test's verify steps keeping all, one and none of their drafts, then a verify step and a
    plain step planned ahead of them: replayed graphs read the rejected counts on the device."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "speculative"))
    from test_plan_ahead import assert_rows_planned_ahead_emit_plain_tokens

    torch.backends.cuda.matmul.allow_tf32 = False
    save_tiny_llama(tmp_path)
    assert_rows_planned_ahead_emit_plain_tokens(str(tmp_path), "cuda", graphs=True)


HIDDEN_STATE = [
    ("mtp", "deepseek_v3"),
    ("mtp", "deepseek_v4"),
    ("dspark", "llama"),
    ("dspark", "deepseek_v4"),
    ("draft-model", "llama"),  # the target as its own draft
]


@pytest.mark.parametrize(("algorithm", "family"), HIDDEN_STATE, ids=[f"{a}-{f}" for a, f in HIDDEN_STATE])
def test_drafters_that_follow_the_target_replay_the_captured_graphs(tmp_path, algorithm, family):
    """MTP, DSpark and the draft model follow the target (its hidden states, tapped layers, tokens) from
    inside the captured decode and verify graphs: greedy outputs equal plain decoding's, the speculation counters and the state kept
    per KV slot equal an eager runner's (overlap off: the same plans), and with overlap on rows are
    planned ahead and moved back inside the verify graphs (both draft on the device)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "speculative"))
    from test_lossless import batch
    from test_verify_graph_path import _drafter_state

    torch.backends.cuda.matmul.allow_tf32 = False
    if algorithm == "mtp":
        SAVE[family](tmp_path, mtp_layers=1)
    else:
        SAVE[family](tmp_path)
    v4 = {"swa_replay_exact": True} if family == "deepseek_v4" else {}

    def runner(**more) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(tmp_path), device="cuda", dtype="float32", num_kv_slots=4096,
                                        max_reqs=8, max_model_len=256, **v4, **more))  # fmt: skip

    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    if algorithm == "draft-model":
        spec["speculative_draft_model_path"] = str(tmp_path)
    plain, eager, graphed = runner(), runner(cuda_graph=False, **spec), runner(**spec)
    assert (
        graphed.graphs is not None and graphed.graphs.verify_graphs and graphed.graphs.hidden_sink is not None
    )
    assert graphed.verify_ahead
    replays = []
    run_verify = graphed.graphs.run_verify
    graphed.graphs.run_verify = lambda plan: replays.append(any(plan.assume_accepted)) or run_verify(plan)
    reqs = batch(False, n=6, max_new=24)

    def run(r: ModelRunner, **cfg):  # noqa: ANN202
        cfg = ServerConfig(device="cuda", max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=2048,
                           page_size=r.page_size, speculative_draft_policy="fixed", **cfg)  # fmt: skip
        return asyncio.run(run_scheduler(cfg, reqs, runner=r, max_model_len=256))[0]

    want = run(plain)
    results = [run(r, disable_overlap=True) for r in (eager, graphed)]
    kept = [[t.clone() for t in _drafter_state(r)] for r in (eager, graphed)]
    results.append(run(graphed))
    for got in results:
        assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want.tokens[r.rid] for r in reqs}
    assert replays, "no verify step replayed a graph"
    e, g, overlapped = (r.stats.spec for r in results)
    assert (e.steps, e.drafted, e.accepted) == (g.steps, g.drafted, g.accepted) and g.drafted > 0
    assert overlapped.ahead_rows > 0 and any(replays), overlapped
    for a, b in zip(*kept, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)

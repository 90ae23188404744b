"""DeepSeek-V4 decode steps through the batched path (deepseek_v4/attention_decode.py) against the request-by-request
path of deepseek_v4/attention.py, on two runners of the same tiny checkpoint fed the same plans (float32,
CPU): rows at different phases of the CSA (rate 4) and HCA (rate 8) windows and of the sliding window,
a row reused by a new request mid-run (its old state is still in the row's slices), and a prefix hit
whose state starts past 0 (replay). Every step's logits must agree up to the order of the softmax sums,
and the batched path must be the one decode steps took; also on the padded static-buffer path of CUDA
graphs (`prepare_decode_graph`). Verify steps likewise (k drafts a row, q_len = k + 1 places, rejected
positions rolled back): eagerly when every row has the same drafts, and on the padded static-buffer path
of verify graphs (rows of fewer drafts leave padding places)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4 import attention as v4_ref
from runtime.gpu.models.deepseek_v4 import attention_decode as v4_decode
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_decode_scenario, v4_verify_scenario


@pytest.fixture(scope="module", params=sorted(V4_TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek_v4(path, seed=7, **V4_TINY_CONFIGS[request.param])
    return path


def _runner(path, batched: bool, **spec) -> ModelRunner:
    cfg = RunnerConfig(str(path), num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1, **spec)
    runner = ModelRunner(cfg)
    runner.attn.batched_decode = batched
    return runner


@pytest.mark.parametrize("graphs", [False, True])
def test_batched_decode_matches_the_per_row_path(checkpoint, monkeypatch, graphs):
    """graphs: decode steps on the padded static-buffer path GraphRunner captures (run eagerly here;
    3 rows pad to 4 with row 0, whose state the real rows never read), with context buckets of 32 and
    128 (max_model_len) tokens, both replayed."""
    calls = []
    forward = v4_decode.forward
    monkeypatch.setattr(v4_decode, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    want = v4_decode_scenario(_runner(checkpoint, batched=False))
    assert not calls
    runner = _runner(checkpoint, batched=True)
    runs = []
    if graphs:
        monkeypatch.setattr(v4_ref, "GRAPH_CONTEXT_START", 32)
        runner.graphs = runner.make_graphs(4, capture=False)
        assert runner.graphs.contexts == [32, 128]
        run = runner.graphs.run
        runner.graphs.run = lambda plan: runs.append(runner.graphs.context(plan)) or run(plan)
    got = v4_decode_scenario(runner)
    assert len(runs) == (26 if graphs else 0)
    if graphs:
        assert set(runs) == {32, 128}, runs
    layers = len(runner.model.attention_layers())
    assert len(calls) == 26 * layers  # every decode step, every layer; the prefills went request by request
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")


@pytest.mark.parametrize("mode", ["eager-4", "eager-block", "graphs-ragged"])
def test_batched_verify_steps_match_the_per_row_path(checkpoint, monkeypatch, mode):
    """Verify steps of q_len = 4 and of the longest block the rings and tails roll back (8 places; 5 with
    the window of 5), eagerly (every row the same drafts) and on the verify graphs' padded path (q_len
    places a row, 3 rows padded to 4, rows of fewer drafts), against request by request."""
    q_len = 4 if mode == "eager-4" else _runner(checkpoint, batched=True).kv_pool.max_verify_block
    spec = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": q_len - 1}
    ragged = mode == "graphs-ragged"
    want = v4_verify_scenario(_runner(checkpoint, batched=False, **spec), q_len, ragged)
    places = []
    forward = v4_decode.forward
    monkeypatch.setattr(v4_decode, "forward", lambda *a, **k: places.append(a[6].q_len) or forward(*a, **k))
    runner = _runner(checkpoint, batched=True, **spec)
    runs = []
    if ragged:
        monkeypatch.setattr(v4_ref, "GRAPH_CONTEXT_START", 64)
        runner.graphs = runner.make_graphs(4, capture=False)
        assert runner.graphs.q_len == q_len and runner.graphs.contexts == [64, 128]
        run = runner.graphs.run_verify
        runner.graphs.run_verify = lambda plan: runs.append(max(plan.prefix_lens) + q_len) or run(plan)
    got = v4_verify_scenario(runner, q_len, ragged)
    layers = len(runner.model.attention_layers())
    assert places.count(q_len) == 16 * layers  # every verify step, every layer, on the batched path
    if ragged:
        assert len(runs) == 16 and min(runs) <= 64 < max(runs), runs  # both context buckets
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")


def test_the_backend_decodes_every_row_at_once_under_cuda_graphs():
    from runtime.gpu.models.deepseek_v4.attention import TorchV4Backend

    default = TorchV4Backend(4, 16, 8)
    assert default.batched_decode and default.supports_cuda_graph and default.supports_verify_graph


def test_graph_context_buckets():
    """A V4 graph's entry widths are its context / rate: buckets x4 from 16K up to max_model_len."""
    from runtime.gpu.attention.base import AttentionBackend
    from runtime.gpu.models.deepseek_v4.attention import TorchV4Backend

    v4 = TorchV4Backend(4, 16, 8)
    assert v4.graph_contexts(8192) == [8192]
    assert v4.graph_contexts(16384) == [16384]
    assert v4.graph_contexts(100_000) == [16384, 65536, 100_000]
    assert v4.graph_contexts(1 << 20) == [16384, 65536, 262144, 1 << 20]
    assert AttentionBackend.graph_contexts(v4, 100_000) == [100_000]  # others: one, max_model_len

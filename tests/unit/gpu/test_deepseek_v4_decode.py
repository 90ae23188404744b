"""DeepSeek-V4 decode steps through the batched path (attention/v4_decode.py) against the request-by-request
path of attention/v4_ref.py, on two runners of the same tiny checkpoint fed the same plans (float32,
CPU): rows at different phases of the CSA (rate 4) and HCA (rate 8) windows and of the sliding window,
a row reused by a new request mid-run (its old state is still in the row's slices), and a prefix hit
whose state starts past 0 (replay). Every step's logits must agree up to the order of the softmax sums,
and the batched path must be the one decode steps took; also on the padded static-buffer path of CUDA
graphs (`prepare_decode_graph`)."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.attention import v4_decode
from runtime.gpu.cuda_graph import DecodeGraphs
from runtime.gpu.model_runner import ModelRunner, RunnerConfig
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_decode_scenario


@pytest.fixture(scope="module", params=sorted(V4_TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek_v4(path, seed=7, **V4_TINY_CONFIGS[request.param])
    return path


def _runner(path, batched: bool) -> ModelRunner:
    cfg = RunnerConfig(str(path), num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1)
    runner = ModelRunner(cfg)
    runner.attn_backend.batched_decode = batched
    return runner


@pytest.mark.parametrize("graphs", [False, True])
def test_batched_decode_matches_the_per_row_path(checkpoint, monkeypatch, graphs):
    """graphs: decode steps on the padded static-buffer path DecodeGraphs captures (run eagerly here;
    3 rows pad to 4 with row 0, whose state the real rows never read)."""
    calls = []
    forward = v4_decode.forward
    monkeypatch.setattr(v4_decode, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    want = v4_decode_scenario(_runner(checkpoint, batched=False))
    assert not calls
    runner = _runner(checkpoint, batched=True)
    runs = []
    if graphs:
        runner.graphs = DecodeGraphs(runner, max_bs=4, capture=False)
        run = runner.graphs.run
        runner.graphs.run = lambda plan: runs.append(1) or run(plan)
    got = v4_decode_scenario(runner)
    assert len(runs) == (26 if graphs else 0)
    layers = len(runner.model.attention_layers())
    assert len(calls) == 26 * layers  # every decode step, every layer; the prefills went request by request
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")


def test_the_environment_switch_picks_the_decode_path(monkeypatch):
    from runtime.gpu.attention.v4_ref import TorchV4Backend

    assert TorchV4Backend(4, 16, 8).batched_decode
    monkeypatch.setenv("CONDUIT_V4_BATCHED_DECODE", "0")
    assert not TorchV4Backend(4, 16, 8).batched_decode

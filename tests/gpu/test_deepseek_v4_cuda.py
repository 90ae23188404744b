"""DeepSeek-V4 on CUDA (TorchV4Backend through the paged pools, its attention on the `sparse_attention`
op): float32 logits match transformers' use_cache=False forwards (prefill, chunked prefill, decode),
bfloat16 stays within bf16 tolerance of them, an exact-replay prefix hit equals a cold run on the
device, and decode and verify steps captured in CUDA graphs (the batched path,
models/deepseek_v4/attention_decode.py) compute what eager request-by-request steps compute."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import (
    PagedPlanBuilder,
    save_tiny_deepseek_v4,
    seq_start,
    v4_decode_scenario,
    v4_hit_vs_cold,
    v4_verify_scenario,
)

pytestmark = pytest.mark.gpu

PAGE = 8
TOL = 1e-4  # float32; bfloat16 is held to transformers' own bfloat16 error (random tiny V4: about 0.8)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    return path, save_tiny_deepseek_v4(path, seed=5).eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_prefill_chunked_and_decode_match_transformers(model, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, ref = model
    runner = ModelRunner(RunnerConfig(str(path), device="cuda", dtype=dtype, num_kv_slots=1024, max_reqs=8,
                                      max_model_len=256))  # fmt: skip
    ids = _prompt(50, seed=2)
    with torch.no_grad():
        expected = ref(torch.tensor([ids]), use_cache=False).logits[0].float()
    pb = PagedPlanBuilder(PAGE)
    cuts = [0, 3, 11, 12, 16, 31, 40]
    got = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        added = [seq_start(2, ids)] if i == 0 else []
        got.append(runner.forward_logits(pb.plan([2], [a], [b - a], ids[a:b], added=added))[0])
    for pos in range(40, len(ids)):  # then token by token
        got.append(runner.forward_logits(pb.plan([2], [pos], [1], [ids[pos]]))[0])
    positions = [b - 1 for b in cuts[1:]] + list(range(40, len(ids)))
    err = (torch.stack(got).float().cpu() - expected[positions]).abs().max().item()
    if dtype == "float32":
        assert err < TOL, f"max abs logit diff {err:.3g}"
        return
    with torch.no_grad():  # the yardstick: transformers itself in bfloat16 against its float32
        theirs = ref.to(torch.bfloat16)(torch.tensor([ids]), use_cache=False).logits[0].float()
    ref.float()
    ref_err = (theirs[positions] - expected[positions]).abs().max().item()
    assert err <= 1.5 * ref_err + 0.05, f"bf16 max abs logit diff {err:.3g}, transformers bf16 {ref_err:.3g}"


def test_cuda_exact_replay_hit_equals_a_cold_run(model):
    path, _ = model
    runner = ModelRunner(RunnerConfig(str(path), device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=8,
                                      max_model_len=256))  # fmt: skip
    r = v4_hit_vs_cold(runner, prefix_len=32, replay=32, seed=3)
    assert r.cache_untouched
    assert (r.hit - r.cold).abs().max().item() < 1e-4
    assert r.hit_tokens == r.cold_tokens


def test_cuda_graph_decode_matches_eager_request_by_request(model):
    """CUDA graphs (the default; --disable-cuda-graph turns them off): the runner captures its
    decode buckets (1, 2, 4) over the batched path; every step of the shared V4 decode scenario (rows at
    every window phase, a reused row, a prefix hit) matches a runner without graphs that attends request
    by request, float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = model

    def runner(graphs: bool) -> ModelRunner:
        cfg = RunnerConfig(str(path), device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=4,
                           max_model_len=128, cuda_graph=graphs)  # fmt: skip
        r = ModelRunner(cfg)
        r.attn.batched_decode = graphs
        return r

    eager, captured = runner(False), runner(True)
    assert eager.graphs is None and captured.graphs is not None and captured.graphs.capture_graphs
    want, got = v4_decode_scenario(eager), v4_decode_scenario(captured)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g.float() - w.float()).abs().max().item()
        assert err < TOL, f"step {i}: max abs logit diff {err:.3g}"


def test_cuda_verify_graphs_match_eager_request_by_request(model):
    """Verify graphs (q_len = 4 places a row, rows of 0-3 drafts, rejected positions rolled back): the
    runner captures its verify buckets (1, 2, 4) over the batched path and replays them for every verify
    step of the shared V4 verify scenario, which matches a runner without graphs attending request by
    request, float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, _ = model

    def runner(graphs: bool) -> ModelRunner:
        cfg = RunnerConfig(str(path), device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=4,
                           max_model_len=128, cuda_graph=graphs, speculative_algorithm="ngram",
                           speculative_num_draft_tokens=3)  # fmt: skip
        r = ModelRunner(cfg)
        r.attn.batched_decode = graphs
        return r

    eager, captured = runner(False), runner(True)
    assert captured.graphs is not None and captured.graphs.verify_graphs and captured.graphs.q_len == 4
    replays = []
    run_verify = captured.graphs.run_verify
    captured.graphs.run_verify = lambda plan: replays.append(len(plan.rows)) or run_verify(plan)
    want, got = v4_verify_scenario(eager, 4, ragged=True), v4_verify_scenario(captured, 4, ragged=True)
    assert len(replays) == 16
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g.float() - w.float()).abs().max().item()
        assert err < TOL, f"step {i}: max abs logit diff {err:.3g}"

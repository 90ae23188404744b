"""Our DeepSeek-V4 matches transformers' DeepseekV4ForCausalLM (use_cache=False full forwards, float32):
full prefill, chunked prefill and token-by-token decode through the paged pools (compressed entries and
indexer keys addressed through shuffled, position-aligned pages of 8 slots, as the scheduler lays them
out) and the per-row state (sliding-window ring, compressor tails), on checkpoints saved to disk and
loaded by name (upstream names, as transformers writes them)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import V4_TINY_CONFIGS, PagedPlanBuilder, save_tiny_deepseek_v4, seq_start

TOL = 1e-4
PAGE = 8  # lcm of the compress rates 4 and 8: a page holds whole windows
CONFIGS = V4_TINY_CONFIGS


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_deepseek_v4(path, seed=5, **CONFIGS[request.param])
    runner = ModelRunner(
        RunnerConfig(str(path), num_kv_slots=1024, max_reqs=8, max_model_len=256, cpu_threads=1)
    )
    return ref, runner


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=g).tolist()


def oracle(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids]), use_cache=False).logits[0].float()


def test_full_prefill_matches_reference_at_every_position(tiny):
    ref, runner = tiny
    ids = prompt(45, seed=1)  # 11 CSA entries (indexer picks 2), 5 HCA entries, windows slide
    plan = PagedPlanBuilder(PAGE).plan([1], [0], [45], ids, added=[seq_start(1, ids)])
    logits = runner.token_logits(plan)  # all positions, not only the sampled one
    torch.testing.assert_close(logits, oracle(ref, ids), atol=TOL, rtol=0)


def test_chunked_prefill_matches_reference(tiny):
    """Chunk edges inside and on window boundaries, one of them a single token."""
    ref, runner = tiny
    ids = prompt(50, seed=2)
    expected = oracle(ref, ids)
    pb = PagedPlanBuilder(PAGE)
    cuts = [0, 3, 11, 12, 16, 31, 50]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        added = [seq_start(2, ids)] if i == 0 else []
        logits = runner.forward_logits(pb.plan([2], [a], [b - a], ids[a:b], added=added))
        torch.testing.assert_close(logits[0], expected[b - 1], atol=TOL, rtol=0)


def test_token_by_token_decode_through_the_state(tiny):
    ref, runner = tiny
    ids = prompt(36, seed=3)
    expected = oracle(ref, ids)
    pb = PagedPlanBuilder(PAGE)
    runner.forward_logits(pb.plan([3], [0], [1], ids[:1], added=[seq_start(3, ids)]))
    got = [runner.forward_logits(pb.plan([3], [pos], [1], [ids[pos]]))[0] for pos in range(1, len(ids))]
    torch.testing.assert_close(torch.stack(got), expected[1:], atol=TOL, rtol=0)


def test_mixed_batch_and_row_reuse(tiny):
    """Two rows prefill, then decode alongside a third that reuses a released row's slot."""
    ref, runner = tiny
    a, b, c = prompt(30, 11), prompt(21, 12), prompt(17, 13)
    pb = PagedPlanBuilder(PAGE)
    runner.forward_logits(
        pb.plan([4, 5], [0, 0], [29, 20], a[:29] + b[:20], added=[seq_start(4, a), seq_start(5, b)])
    )
    plan = pb.plan([4, 3, 5], [29, 0, 20], [1, 17, 1], [a[29]] + c + [b[20]], added=[seq_start(3, c)])
    logits = runner.forward_logits(plan)
    expected = torch.stack([oracle(ref, s)[-1] for s in (a, c, b)])
    torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)


def test_mtp_block_loads_from_upstream_names_and_runs(tmp_path):
    """transformers drops MTP, so the block is checked for loading (upstream `mtp.0.*` names land in
    `layers.{n}`) and for running, not against an oracle; the main model's logits are unaffected."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ref = save_tiny_deepseek_v4(tmp_path, seed=6, num_nextn_predict_layers=1)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        main = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(0)
    mtp = {}
    for k, t in main.items():  # a sliding-attention block (layer 0) with a learned-routing MoE (layer 1)
        if k.startswith("model.layers.0.") and ".ffn." not in k:
            mtp["mtp.0." + k.removeprefix("model.layers.0.")] = t.clone()
        elif k.startswith("model.layers.1.ffn."):
            mtp["mtp.0." + k.removeprefix("model.layers.1.")] = t.clone()
    d, n = 64, 2
    extra = {"enorm.weight": [d], "hnorm.weight": [d], "e_proj.weight": [d, d], "h_proj.weight": [d, d]}
    extra |= {"hc_head_fn": [n, n * d], "hc_head_base": [n], "hc_head_scale": [1], "norm.weight": [d]}
    for k, shape in extra.items():
        mtp[f"mtp.0.{k}"] = torch.randn(shape, generator=g) * 0.1 + ("norm" in k or "scale" in k)
    save_file(mtp, str(tmp_path / "mtp.safetensors"))
    runner = ModelRunner(RunnerConfig(str(tmp_path), num_kv_slots=256, max_reqs=4, max_model_len=64))
    model = runner.model
    (block,) = model.mtp_layers
    torch.testing.assert_close(block.self_attn.q_a_proj.weight, mtp["mtp.0.attn.wq_a.weight"], atol=0, rtol=0)
    torch.testing.assert_close(block.hc_head.hc_fn, mtp["mtp.0.hc_head_fn"], atol=0, rtol=0)
    ids = prompt(20, seed=4)
    plan = PagedPlanBuilder(PAGE, num_slots=256).plan([1], [0], [20], ids, added=[seq_start(1, ids)])
    batch = runner.prepare_batch(plan)
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, batch, runner.attn)
        torch.testing.assert_close(model.compute_logits(hidden), oracle(ref, ids), atol=TOL, rtol=0)
        streams = torch.randn(20, n, d, generator=g)
        logits = model.compute_logits(
            model.mtp_forward(0, batch.input_ids, streams, batch.positions, batch, runner.attn)
        )
    assert logits.shape == (20, 128) and torch.isfinite(logits).all()


def test_fp8_kv_cache_is_refused_with_the_model_named(tmp_path):
    """V4's compressed and sliding-window state has no e4m3 path: --kv-cache-dtype fp8_e4m3 is a clear
    error naming the model, not a silent full-precision pool."""
    save_tiny_deepseek_v4(tmp_path, seed=1)
    cfg = RunnerConfig(
        str(tmp_path), num_kv_slots=64, max_reqs=2, max_model_len=32, kv_cache_dtype="fp8_e4m3"
    )
    with pytest.raises(ValueError, match="DeepseekV4ForCausalLM"):
        ModelRunner(cfg)

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("runtime.gpu.model_runner")

from loadgen.cli import main  # noqa: E402


def test_steps_prints_a_sane_table_on_cpu_with_a_tiny_config(capsys):
    rc = main(["steps", "--device", "cpu", "--batch-sizes", "2,4", "--context-len", "32", "--draft-tokens", "0,2",
               "--prefill-tokens", "16", "--prefill-context", "8", "--steps", "2", "--warmup-steps", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("decode", "prefill"))]
    assert [r[0] for r in rows] == ["decode"] * 4 + ["prefill"]
    for r in rows:
        step_ms, tok_s = float(r[5]), float(r[6])
        mbu, mfu = float(r[7].rstrip("%")), float(r[8].rstrip("%"))
        assert step_ms > 0 and tok_s > 0
        assert 0 <= mbu < 100 and 0 < mfu < 100
        roof_ms, layer_ms, of_roof = float(r[9]), float(r[10]), float(r[11].rstrip("%"))
        assert roof_ms > 0 and layer_ms == pytest.approx(roof_ms / 2, abs=1e-3)  # the tiny Llama's 2 layers
        assert (
            of_roof
            == pytest.approx(100 * roof_ms / step_ms, abs=0.1)
            == pytest.approx(max(mbu, mfu), abs=0.1)
        )
    assert "copy" in out and "matmul" in out


def test_steps_times_decode_overlapped_and_waited_side_by_side(capsys):
    rc = main(["steps", "--device", "cpu", "--batch-sizes", "2", "--context-len", "16", "--prefill-tokens", "",
               "--overlap", "both", "--steps", "2", "--warmup-steps", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("decode")]
    assert [r[0] for r in rows] == ["decode", "decode-s"]
    assert all(float(r[5]) > 0 for r in rows)
    assert "-s: each step waited for" in out


def test_steps_with_a_missing_model_dir_is_a_one_line_error(tmp_path, capsys):
    assert main(["steps", "--model-path", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: model directory not found")


def test_moe_weights_count_the_experts_a_step_reaches(tmp_path):
    """A tiny DeepSeek-V3 (routed experts in every MoE layer): one token reads and multiplies exactly
    top_k experts per layer; many tokens read nearly every expert; a dense Llama reads everything."""
    from loadgen.steps import WeightCount
    from runtime.config import RunnerConfig
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing import save_tiny_deepseek_v3, save_tiny_llama

    save_tiny_deepseek_v3(tmp_path / "v3", seed=1)
    runner = ModelRunner(RunnerConfig(str(tmp_path / "v3"), num_kv_slots=64, max_reqs=2, max_model_len=32))
    w = WeightCount.of(runner.model, runner.config)
    c = runner.config
    assert w.moe_layers and all(
        e == c.n_routed_experts and k == c.num_experts_per_tok for e, k, _, _ in w.moe_layers
    )
    experts = sum(e * size for e, _, size, _ in w.moe_layers)
    assert w.total_bytes == w.dense_bytes + experts
    one = w.dense_bytes + sum(k * size for _, k, size, _ in w.moe_layers)
    assert w.bytes_read(1) == pytest.approx(one)
    assert w.bytes_read(1) < w.bytes_read(8) < w.bytes_read(10_000) == pytest.approx(w.total_bytes)
    all_params = sum(p.numel() for p in runner.model.parameters()) - c.vocab_size * c.hidden_size
    assert w.params_per_token < all_params

    # routed as the step is: the distinct experts its tokens reach, per MoE layer
    reached = [k for _, k, _, _ in w.moe_layers]
    assert w.bytes_read(10_000, reached) == pytest.approx(one)

    save_tiny_llama(tmp_path / "llama", seed=1)
    runner = ModelRunner(RunnerConfig(str(tmp_path / "llama"), num_kv_slots=64, max_reqs=2, max_model_len=32))
    w = WeightCount.of(runner.model, runner.config)
    assert not w.moe_layers and w.bytes_read(1) == w.bytes_read(100) == w.total_bytes


def test_expert_reach_hooks_one_eager_step_and_counts_distinct_experts(tmp_path):
    """`expert_reach` runs a plan once more with hooks on every RoutedExperts: per MoE layer, the distinct
    expert ids the step's tokens were routed to (top_k for one token, at most E), then removes the hooks."""
    from loadgen.steps import expert_reach
    from runtime.config import RunnerConfig
    from runtime.gpu.layers.moe import RoutedExperts
    from runtime.gpu.model_runner import ModelRunner
    from runtime.gpu.testing import save_tiny_deepseek_v3, save_tiny_llama
    from runtime.mailbox.messages import SamplingParams, SeqStart, StepPlan

    save_tiny_deepseek_v3(tmp_path / "v3", seed=1)
    runner = ModelRunner(RunnerConfig(str(tmp_path / "v3"), num_kv_slots=64, max_reqs=2, max_model_len=32))
    c = runner.config

    def prefill(step: int, n: int) -> StepPlan:
        start = (
            [SeqStart(1, SamplingParams(temperature=0.0), list(range(3, 3 + n)), [], [])] if step == 1 else []
        )
        return StepPlan(step=step, added=start, released=[], rows=[1], prefix_lens=[0], extend_lens=[n],
                        use_last=[False], input_ids=list(range(3, 3 + n)), out_loc=list(range(1, n + 1)),
                        sample=[True])  # fmt: skip

    layers = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
    one = expert_reach(runner, prefill(1, 1))
    assert one is not None and len(one) == len(layers)
    assert all(n == c.num_experts_per_tok for n in one)
    many = expert_reach(runner, prefill(2, 16))
    assert all(c.num_experts_per_tok <= n <= c.n_routed_experts for n in many)
    assert all(not m._forward_pre_hooks for m in layers)

    save_tiny_llama(tmp_path / "llama", seed=1)
    dense = ModelRunner(RunnerConfig(str(tmp_path / "llama"), num_kv_slots=64, max_reqs=2, max_model_len=32))
    assert expert_reach(dense, prefill(1, 4)) is None


def test_steps_times_deepseek_v4_decode_and_prefill_on_whole_window_pages(tmp_path, capsys):
    """V4 keeps per-row state a fake cached context never built (it starts at position 0, values
    meaningless) and needs pages of whole compression windows: a smaller --page-size is a one-line error."""
    from runtime.gpu.testing import save_tiny_deepseek_v4

    save_tiny_deepseek_v4(tmp_path, seed=1)
    args = ["steps", "--model-path", str(tmp_path), "--device", "cpu", "--context-len", "40", "--steps", "2",
            "--warmup-steps", "1", "--prefill-tokens", "24", "--prefill-context", "16"]  # fmt: skip
    assert main([*args, "--batch-sizes", "1,3", "--page-size", "8"]) == 0
    rows = [
        line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("decode", "prefill"))
    ]
    assert [r[0] for r in rows] == ["decode", "decode", "prefill"] and all(float(r[5]) > 0 for r in rows)
    assert main([*args, "--batch-sizes", "1"]) == 2
    assert "needs --page-size a multiple of 8" in capsys.readouterr().err


def test_deepseek_v4_attention_flops_count_only_the_entries_a_token_reads():
    """V4's MFU counts the window, the CSA's top-k selected entries plus its indexer's scoring, and the
    HCA's compressed entries; not every cached key. Other models: every key, causally."""
    from types import SimpleNamespace

    from loadgen.steps import attention_flops

    v4 = SimpleNamespace(
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128, index_topk=512, index_n_heads=64, index_head_dim=128,
    )  # fmt: skip
    per_key = 4 * 64 * 512
    # one decode token at context 8191 (it sees 8192 positions): 128 + (128 + 512) + (128 + 64) keys
    want = per_key * (128 + 128 + 512 + 128 + 64) + 2 * 64 * 128 * 2048
    assert attention_flops(v4, 3, 64, 512, 8191, 1) == want
    # a dense model attends every key: 8192 of them on each of 3 layers
    assert attention_flops(SimpleNamespace(), 3, 64, 512, 8191, 1) == per_key * 3 * 8192

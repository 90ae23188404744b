"""Our Llama through the paged cache and the runner matches transformers' logits (float32)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, reference_logits, save_tiny_llama, seq_start, shuffled_slots
from runtime.gpu.testing import random_prompt as prompt

# float32 logits; the real SmolLM2's (|logit| up to ~25) once differed by 1.03e-4 from transformers' in a
# full-suite run (a different summation order in a CPU GEMM), so the bound leaves that room
TOL = 2e-4
LLAMA3_ROPE = dict(
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    ),
)
CONFIGS = {
    "mha": dict(),
    "gqa_tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=1, head_dim=32, **LLAMA3_ROPE),
    "biases": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True),  # norms stay unfolded
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_llama(path, **CONFIGS[request.param])
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=1024, max_reqs=8, max_model_len=256))
    return ref, runner


def test_norms_are_folded_unless_a_projection_has_a_bias(tiny):
    ref, runner = tiny
    assert runner.model.model.norms_folded == (not ref.config.attention_bias)


@pytest.mark.parametrize("folded_max", [512, 0], ids=["folded_path", "norm_kernels_on_folded_weights"])
def test_full_prefill_matches_reference(tiny, monkeypatch, folded_max: int):
    """Both forms of a step over folded weights (small steps fold, big ones run unit-gain norms)."""
    monkeypatch.setattr("runtime.gpu.models.llama.model.FOLDED_MAX_TOKENS", folded_max)
    ref, runner = tiny
    ids = prompt(40, seed=1)
    pb = PlanBuilder(shuffled_slots(1))
    logits = runner.forward_logits(pb.plan([1], [0], [40], ids, added=[seq_start(1, ids)]))
    torch.testing.assert_close(logits[0], reference_logits(ref, ids)[-1], atol=TOL, rtol=0)


def test_chunked_prefill_matches_reference(tiny):
    ref, runner = tiny
    ids = prompt(50, seed=2)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(2))
    cuts = [0, 17, 33, 50]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        added = [seq_start(2, ids)] if i == 0 else []
        plan = pb.plan([2], [a], [b - a], ids[a:b], added=added)
        logits = runner.forward_logits(plan)
        torch.testing.assert_close(logits[0], expected[b - 1], atol=TOL, rtol=0)


def test_token_by_token_decode_through_shuffled_slots(tiny):
    ref, runner = tiny
    ids = prompt(24, seed=3)
    expected = reference_logits(ref, ids)
    pb = PlanBuilder(shuffled_slots(3))
    runner.forward_logits(pb.plan([3], [0], [4], ids[:4], added=[seq_start(3, ids)]))
    for pos in range(4, len(ids)):
        logits = runner.forward_logits(pb.plan([3], [pos], [1], [ids[pos]]))
        torch.testing.assert_close(logits[0], expected[pos], atol=TOL, rtol=0)


def test_mixed_batch_of_prefill_chunks_and_decodes(tiny):
    """Decode rows fed from last_token, a fresh prefill, a continued chunk and a 1-token prompt in one step."""
    ref, runner = tiny
    a, b, c, d = prompt(30, 11), prompt(20, 12), prompt(26, 13), prompt(1, 14)
    pb = PlanBuilder(shuffled_slots(4))
    # Step 1: A fully prefilled, C's first chunk (not sampled).
    plan = pb.plan([4, 6], [0, 0], [29, 10], a[:29] + c[:10], sample=[True, False])
    plan = type(plan)(**{**_fields(plan), "added": [seq_start(4, a), seq_start(6, c)]})
    runner.forward_logits(plan)
    runner.tables.last_token[4] = a[29]  # as if step 1 had sampled A's next token
    # Step 2: A decodes via use_last, B prefills, C continues, D is a one-token prompt.
    plan = pb.plan(
        [5, 4, 6, 7],
        [0, 29, 10, 0],
        [20, 1, 16, 1],
        b + c[10:] + d,
        use_last=[False, True, False, False],
        added=[seq_start(5, b), seq_start(7, d)],
    )
    logits = runner.forward_logits(plan)
    expected = [reference_logits(ref, s)[-1] for s in (b, a, c, d)]
    torch.testing.assert_close(logits, torch.stack(expected), atol=TOL, rtol=0)
    # Step 3: all four decode together (one padded SDPA call) with different lengths.
    nxt = prompt(4, 15)
    plan = pb.plan([4, 5, 6, 7], [30, 20, 26, 1], [1, 1, 1, 1], nxt)
    logits = runner.forward_logits(plan)
    expected = [reference_logits(ref, s + [t])[-1] for s, t in zip((a, b, c, d), nxt, strict=True)]
    torch.testing.assert_close(logits, torch.stack(expected), atol=TOL, rtol=0)


def _fields(plan) -> dict:
    return {f: getattr(plan, f) for f in plan.__struct_fields__}


def test_smollm2_prefill_and_decode_match_transformers(smollm2_path, smollm2_hf):
    runner = ModelRunner(RunnerConfig(str(smollm2_path), num_kv_slots=1024, max_reqs=4, max_model_len=256))
    ids = [1, 4093, 28, 1048, 314, 253, 1345, 2060, 30, 457, 4413, 314, 216, 7, 30]
    pb = PlanBuilder(shuffled_slots(5)[:200])
    out = runner.execute(pb.plan([1], [0], [len(ids)], ids, added=[seq_start(1, ids)]))
    seq = ids + out.tokens
    for _ in range(3):
        expected = reference_logits(smollm2_hf, seq)[-1]
        logits = runner.forward_logits(pb.plan([1], [len(seq) - 1], [1], [seq[-1]]))
        torch.testing.assert_close(logits[0], expected, atol=TOL, rtol=0)
        seq.append(int(expected.argmax()))

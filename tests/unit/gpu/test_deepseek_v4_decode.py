"""DeepSeek-V4 decode steps through the batched path (attention/v4_decode.py) against the request-by-request
path of attention/v4_ref.py, on two runners of the same tiny checkpoint fed the same plans (float32,
CPU): rows at different phases of the CSA (rate 4) and HCA (rate 8) windows and of the sliding window,
a row reused by a new request mid-run (its old state is still in the row's slices), and a prefix hit
whose state starts past 0 (replay). Every step's logits must agree up to the order of the softmax sums,
and the batched path must be the one decode steps took."""

from __future__ import annotations

import pytest
import torch

from runtime.gpu.attention import v4_decode
from runtime.gpu.model_runner import ModelRunner, RunnerConfig
from runtime.gpu.testing import (
    V4_TINY_CONFIGS,
    PagedPlanBuilder,
    random_prompt,
    save_tiny_deepseek_v4,
    seq_start,
)

PAGE, SLOTS = 8, 1024


@pytest.fixture(scope="module", params=sorted(V4_TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek_v4(path, seed=7, **V4_TINY_CONFIGS[request.param])
    return path


def _runner(path, batched: bool) -> ModelRunner:
    cfg = RunnerConfig(str(path), num_kv_slots=SLOTS, max_reqs=4, max_model_len=128, cpu_threads=1)
    runner = ModelRunner(cfg)
    runner.attn_backend.batched_decode = batched
    return runner


def _scenario(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of every step: rows 1-3 prefilled (2, 14 and 31 tokens: row 1 closes its first CSA and HCA windows while decoding), 12 decode steps; then row 2 takes
    a new request (prefilled beside the others' decodes) and row 4 a prefix hit on row 3's first 16
    tokens, replaying 8; then 14 decode steps of all four rows."""
    vocab, pb, out = runner.vocab_size, PagedPlanBuilder(PAGE, SLOTS, seed=3), []
    prompts = {row: random_prompt(n, 10 + row, vocab) for row, n in ((1, 2), (2, 14), (3, 31))}
    seqs = {row: list(p) for row, p in prompts.items()}

    def step(plan) -> None:
        logits = runner.forward_logits(plan)
        out.append(logits)
        sampled = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
        for row, token in zip(sampled, logits.argmax(-1).tolist(), strict=True):
            seqs[row].append(token)

    def decode(rows: list[int]) -> None:
        step(pb.plan(rows, [len(seqs[r]) - 1 for r in rows], [1] * len(rows), [seqs[r][-1] for r in rows]))

    rows = sorted(prompts)
    ids = [t for r in rows for t in prompts[r]]
    step(
        pb.plan(
            rows,
            [0] * 3,
            [len(prompts[r]) for r in rows],
            ids,
            added=[seq_start(r, prompts[r]) for r in rows],
        )
    )
    for _ in range(12):
        decode(rows)
    # row 2: a new request, prefilled in a step that also decodes rows 1 and 3 (the per-row path)
    new = random_prompt(9, 20, vocab)
    seqs[2] = list(new)
    step(
        pb.plan(
            [1, 2, 3], [len(seqs[1]) - 1, 0, len(seqs[3]) - 1], [1, len(new), 1],
            [seqs[1][-1], *new, seqs[3][-1]], added=[seq_start(2, new)],
        )
    )  # fmt: skip
    # row 4: a hit on row 3's first 16 tokens, replaying 8 (its state starts at position 8)
    hit, replay = 16, 8
    seqs[4] = prompts[3][:hit] + random_prompt(5, 21, vocab)
    slots = pb.share(4, 3, hit)
    step(
        pb.plan(
            [4], [hit - replay], [len(seqs[4]) - hit + replay], seqs[4][hit - replay :],
            added=[seq_start(4, seqs[4], prefix_slots=slots)], replay=[replay],
        )
    )  # fmt: skip
    for _ in range(14):
        decode([1, 2, 3, 4])
    return out


def test_batched_decode_matches_the_per_row_path(checkpoint, monkeypatch):
    calls = []
    forward = v4_decode.forward
    monkeypatch.setattr(v4_decode, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    want = _scenario(_runner(checkpoint, batched=False))
    assert not calls
    got = _scenario(_runner(checkpoint, batched=True))
    layers = len(_runner(checkpoint, batched=True).model.attention_layers())
    assert len(calls) == 26 * layers  # every decode step, every layer; the prefills went request by request
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")

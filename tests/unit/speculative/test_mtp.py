"""The MTP drafter on a tiny random DeepSeek-V3 with one nextn layer: lossless greedy and seeded through
the real scheduler (overlap on and off, radix cache on and off, paged, under retraction; V4's MTP block:
tests/unit/speculative/test_v4.py); its drafts, made incrementally across steps from the hidden states
kept per slot, equal a one-shot pass of the MTP layer over the whole sequence (V3 and V4); and an MTP layer that predicts exactly what the target will say (a target whose
layers add nothing, so its next token depends on the last token only, and an MTP layer that reads only
the next token's embedding) has every draft accepted, chained drafts included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PagedPlanBuilder, save_tiny_deepseek_v3, save_tiny_deepseek_v4, seq_start
from runtime.speculative.drafter import StepTokens
from tests.unit.speculative.test_lossless import (
    MAX_MODEL_LEN,
    SLOTS,
    assert_lossless_in_every_configuration,
    assert_lossless_under_retraction,
    batch,
    run,
)

MTP = {"speculative_algorithm": "mtp", "speculative_num_draft_tokens": 3}


def make_runner(path, **spec) -> ModelRunner:  # noqa: ANN001
    cfg = RunnerConfig(str(path), num_kv_slots=SLOTS, max_reqs=8, max_model_len=MAX_MODEL_LEN, cpu_threads=1,
                       **spec)  # fmt: skip
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3-mtp")
    save_tiny_deepseek_v3(path, mtp_layers=1)
    return path


@pytest.fixture(scope="module")
def runners(checkpoint):
    return make_runner(checkpoint), make_runner(checkpoint, **MTP)


def record_drafts(runner: ModelRunner) -> list[tuple[list[int], list[int]]]:
    """(the row's tokens, its drafts) of every row the drafter drafts for, as the runner runs."""
    drafter, calls = runner.spec.drafter, []
    observe = drafter.observe

    def recording(step):  # noqa: ANN001, ANN202
        drafts = observe(step)
        lengths = drafter.history.length[step.rows].tolist()
        for i, (r, n) in enumerate(zip(step.rows.tolist(), lengths, strict=True)):
            calls.append((drafter.history.ids[r, :n].tolist(), drafts.tokens[i].tolist()))
        return drafts

    drafter.observe = recording
    return calls


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_mtp_speculation_equals_plain_decoding_in_every_configuration(runners, sampled):
    assert_lossless_in_every_configuration(*runners, sampled)


def test_mtp_speculation_survives_retraction(runners):
    assert_lossless_under_retraction(*runners)


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-mtp")
    save_tiny_deepseek_v4(path, mtp_layers=1)
    return path


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v4"])
def test_incremental_mtp_drafts_equal_a_one_shot_pass_over_the_sequence(checkpoint, v4_checkpoint, family):
    """Drafts made during serving (entries completed step by step with the target, accepted and
    rejected blocks, radix hits, paged slots; on V4 the block's ring, with rejected places' and the
    chain's entries restored) against a fresh drafter that sees each sequence once: prefill all but its
    last token, then draft after it."""
    path = checkpoint if family == "deepseek_v3" else v4_checkpoint
    exact = {"swa_replay_exact": True} if family == "deepseek_v4" else {}
    spec = make_runner(path, **MTP, **exact)
    calls = record_drafts(spec)
    run(spec, batch(False), page_size=16, chunked_prefill_size=64, speculative_draft_policy="fixed")
    assert len(calls) >= 10
    fresh = make_runner(path, **MTP, **exact)
    for i, (tokens, drafts) in enumerate(calls[:: max(1, len(calls) // 12)]):
        pb, n = PagedPlanBuilder(16, SLOTS, seed=i), len(tokens)
        released = [1] if i else []
        fresh.execute(pb.plan([1], [0], [n - 1], tokens[:-1], sample=[False], added=[seq_start(1, tokens[:-1])],
                              released=released))  # fmt: skip
        rows = torch.tensor([1])
        step = StepTokens(rows, torch.tensor([[tokens[-1]]]), torch.ones(1, dtype=torch.int64))
        want = fresh.spec.drafter.observe(step).tokens[0].tolist()
        assert drafts == want, f"sequence of {n} tokens"


def _oracle_mtp(src, dst) -> None:  # noqa: ANN001
    """A copy of the checkpoint whose layers add nothing (attention and FFN outputs zero) and whose MTP
    layer passes the next token's normed embedding to the head: it predicts what the target says next."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(src / "model.safetensors")
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    d = t["model.norm.weight"].shape[0]
    mtp = "model.layers.3."
    t[mtp + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
    t[mtp + "enorm.weight"] = torch.ones(d)
    t[mtp + "shared_head.norm.weight"] = t["model.norm.weight"].clone()
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})


def test_an_mtp_layer_that_knows_the_target_has_every_chained_draft_accepted(checkpoint, tmp_path):
    _oracle_mtp(checkpoint, tmp_path / "oracle")
    plain, spec = make_runner(tmp_path / "oracle"), make_runner(tmp_path / "oracle", **MTP)
    reqs = batch(False, eos=False)
    want = run(plain, reqs).tokens
    got = run(spec, reqs)
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}
    s = got.stats.spec
    assert s.accepted == s.drafted > 0
    assert s.lengths[-1] > 0  # rows emitted all K drafts plus their own token
    assert s.ahead_rows > 0  # planned ahead of their verify steps' counts (the CPU settles them first)

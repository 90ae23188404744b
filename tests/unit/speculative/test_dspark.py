"""The DSpark block drafter, randomly initialised, on tiny random Llama and DeepSeek-V3 checkpoints:
lossless greedy and seeded through the real scheduler (overlap on and off, radix cache on and off, paged,
under retraction); the drafts and confidences made right after each serving step (context features kept
per slot across many steps) equal those of a fresh drafter that sees the sequence once; weights load
from the checkpoint's `mtp.*` tensors, where a Markov head that knows a bigram target has every draft
accepted; and the confidence head steers how many drafts the scheduler verifies."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, save_tiny_deepseek_v3, save_tiny_llama, seq_start
from runtime.speculative.dspark import DSparkHead
from tests.unit.speculative.test_lossless import (
    MAX_MODEL_LEN,
    SLOTS,
    assert_lossless_in_every_configuration,
    assert_lossless_under_retraction,
    batch,
    run,
)

DSPARK = {"speculative_algorithm": "dspark", "speculative_num_draft_tokens": 3}
FAMILIES = {"llama": save_tiny_llama, "deepseek_v3": save_tiny_deepseek_v3}


def make_runner(path, **spec) -> ModelRunner:  # noqa: ANN001
    cfg = RunnerConfig(str(path), num_kv_slots=SLOTS, max_reqs=8, max_model_len=MAX_MODEL_LEN, cpu_threads=1,
                       **spec)  # fmt: skip
    return ModelRunner(cfg)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    return path


@pytest.fixture(scope="module")
def runners(checkpoint):
    return make_runner(checkpoint), make_runner(checkpoint, **DSPARK)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_dspark_speculation_equals_plain_decoding_in_every_configuration(runners, sampled):
    assert_lossless_in_every_configuration(*runners, sampled)


def test_dspark_speculation_survives_retraction(runners):
    assert_lossless_under_retraction(*runners)


def test_serving_drafts_equal_a_fresh_drafter_on_the_whole_sequence(checkpoint):
    spec = make_runner(checkpoint, **DSPARK)
    drafter, calls = spec.spec.drafter, []
    draft = drafter.draft

    def recording(rows: torch.Tensor):  # noqa: ANN202
        d = draft(rows)
        for i, r in enumerate(rows.tolist()):
            n = int(drafter.history.length[r])
            calls.append((drafter.history.ids[r, :n].tolist(), d.tokens[i].tolist(), d.confidence[i]))
        return d

    drafter.draft = recording
    run(spec, batch(False), page_size=16, chunked_prefill_size=64)
    assert len(calls) >= 10
    fresh = make_runner(checkpoint, **DSPARK)
    for i, (tokens, drafts, conf) in enumerate(calls[:: max(1, len(calls) // 12)]):
        n, pb = len(tokens), PlanBuilder()
        fresh.execute(pb.plan([1], [0], [n - 1], tokens[:-1], sample=[False], added=[seq_start(1, tokens)],
                              released=[1] if i else []))  # fmt: skip
        want = fresh.spec.drafter.draft(torch.tensor([1]))
        assert drafts == want.tokens[0].tolist(), f"sequence of {n} tokens"
        torch.testing.assert_close(conf, want.confidence[0], rtol=1e-4, atol=1e-5)


def _with_dspark(src, dst, bigram: bool, confidence_bias: float) -> None:  # noqa: ANN001
    """A copy of a tiny V3 checkpoint with `mtp.*` DSpark weights. `bigram`: the target's layers add
    nothing (its next token is a function of the last one), the draft's base logits are zero and the
    Markov table is the target's own map, so every draft is what the target will say."""
    from runtime.gpu.loader import load_config

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(src / "model.safetensors")
    config = load_config(src)
    d = config.hidden_size
    head = DSparkHead(config, n_features=3, n_layers=1, rank=d)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.02)
        head.confidence.weight.zero_()
        head.confidence.bias.fill_(confidence_bias)
        if bigram:
            for name in t:
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    t[name] = torch.zeros_like(t[name])
            e = t["model.embed_tokens.weight"].double()
            normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
            head.markov_w1.weight.copy_(normed * t["model.norm.weight"].double())
            head.markov_w2.weight.copy_(t["lm_head.weight"])
            head.norm.zero_()
    t.update({f"mtp.{k}": v.detach().clone() for k, v in head.state_dict().items()})
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3")
    save_tiny_deepseek_v3(path)
    return path


def test_dspark_weights_from_the_checkpoint_and_a_markov_head_that_knows_the_target(v3, tmp_path):
    _with_dspark(v3, tmp_path / "bigram", bigram=True, confidence_bias=5.0)
    plain, spec = make_runner(tmp_path / "bigram"), make_runner(tmp_path / "bigram", **DSPARK)
    head = spec.spec.drafter.head
    assert float(head.confidence.bias) == 5.0 and float(head.norm.abs().sum()) == 0.0
    reqs = batch(False, eos=False)
    want = run(plain, reqs).tokens
    got = run(spec, reqs)
    assert {r.rid: got.tokens[r.rid] for r in reqs} == {r.rid: want[r.rid] for r in reqs}
    s = got.stats.spec
    assert s.accepted == s.drafted > 0 and s.lengths[-1] > 0
    assert s.ahead_rows > 0  # planned ahead of their verify steps' counts (overlap), the drafts still right


def test_the_confidence_head_decides_how_many_drafts_are_verified(v3, tmp_path):
    """Same drafts, different confidence: sure of them, the scheduler verifies up to K a row; doubtful
    (sigmoid(-8)), it verifies none."""
    drafted = {}
    for name, bias in (("sure", 8.0), ("doubtful", -8.0)):
        _with_dspark(v3, tmp_path / name, bigram=True, confidence_bias=bias)
        got = run(make_runner(tmp_path / name, **DSPARK), batch(False, eos=False))
        drafted[name] = got.stats.spec.drafted
    assert drafted["doubtful"] == 0 < drafted["sure"]


def test_deepseeks_own_dspark_stages_are_refused_with_a_clear_error(v3, tmp_path):
    """A checkpoint with DeepSeek's DSpark stages (V4 blocks under mtp.0/1/2, DeepSeek-V4-Flash-0731) is
    not silently drafted from random weights: the drafter says it cannot read them."""
    dst = tmp_path / "stages"
    dst.mkdir()
    for f in v3.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(v3 / "model.safetensors")
    d = t["model.norm.weight"].shape[0]
    t["mtp.0.main_proj.weight"] = torch.zeros(d, 3 * d)
    t["mtp.2.markov_head.markov_w1.weight"] = torch.zeros(8, 4)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="DeepSeek's own DSpark stages"):
        make_runner(dst, **DSPARK)

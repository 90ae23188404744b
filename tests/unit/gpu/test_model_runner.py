"""ModelRunner.execute: the StepPlan -> StepOutput contract."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, save_tiny_llama, seq_start
from runtime.gpu.warm_up import full_step_shape, warm_up
from runtime.mailbox.messages import SamplingParams, SeqStart


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    ref = save_tiny_llama(path, num_key_value_heads=2)
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=2048, max_reqs=8, max_model_len=128))
    return ref, runner


def greedy_reference(ref, ids: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def test_overlapped_decode_with_use_last_matches_greedy_generate(tiny):
    """Rows feed back their own last token from the device, like an overlap scheduler's plan N+1."""
    ref, runner = tiny
    prompts = {1: [3, 14, 15, 92, 65], 2: [35, 89, 79, 32, 38, 46, 26, 43]}
    pb = PlanBuilder()
    added = [seq_start(r, p) for r, p in prompts.items()]
    out = runner.execute(pb.plan([1, 2], [0, 0], [5, 8], prompts[1] + prompts[2], added=added))
    got = {r: [t] for r, t in zip(out.rows, out.tokens, strict=True)}
    lens = {r: len(p) for r, p in prompts.items()}
    for _ in range(5):
        plan = pb.plan([1, 2], [lens[1], lens[2]], [1, 1], [], use_last=[True, True])
        out = runner.execute(plan)
        for r, t in zip(out.rows, out.tokens, strict=True):
            got[r].append(t)
            lens[r] += 1
    for r, p in prompts.items():
        assert got[r] == greedy_reference(ref, p, 6)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_kv_slots=256, max_reqs=4, max_model_len=64),
        # with the long-row steps and a full-size step (rows 1-5, 2,600 prefill tokens)
        dict(num_kv_slots=4096, max_reqs=8, max_model_len=2100, max_prefill_tokens=2600),
    ],
    ids=["small", "full_step"],
)
def test_the_mixed_step_warm_up_leaves_serving_unchanged(tmp_path, cfg):
    """The warm-up (run at start on CUDA) scribbles on scratch rows and slots only: requests that
    then take those rows and slots generate what transformers does."""
    ref = save_tiny_llama(tmp_path, num_key_value_heads=2)
    runner = ModelRunner(RunnerConfig(str(tmp_path), **cfg))
    warm_up(runner.cfg, runner.kv_pool.num_slots, runner.forward_logits)
    assert runner.tables.req_to_token[1:5].any()  # it ran (a CPU runner does not warm up by itself)
    prompts = {1: [3, 14, 15, 92, 65], 2: [35, 89, 79, 32, 38, 46, 26, 43]}
    pb = PlanBuilder()  # hands out slots from 1, the ones the warm-up wrote
    added = [seq_start(r, p) for r, p in prompts.items()]
    out = runner.execute(pb.plan([1, 2], [0, 0], [5, 8], prompts[1] + prompts[2], added=added))
    got = {r: [t] for r, t in zip(out.rows, out.tokens, strict=True)}
    lens = {r: len(p) for r, p in prompts.items()}
    for _ in range(3):
        out = runner.execute(pb.plan([1, 2], [lens[1], lens[2]], [1, 1], [], use_last=[True, True]))
        for r, t in zip(out.rows, out.tokens, strict=True):
            got[r].append(t)
            lens[r] += 1
    assert got == {r: greedy_reference(ref, p, 4) for r, p in prompts.items()}


def test_the_full_size_warm_up_step_is_a_serving_mixed_step_within_the_limits():
    """Two decode rows with long contexts beside the prefill budget in rows of at most 1024 tokens, the
    first continuing a cached prefix; inside the rows, slots and model length; none when it adds
    nothing over the small shapes."""

    def shape(**kw):
        return full_step_shape(RunnerConfig("unused", **kw))

    n_dec, dec_prefix, prefills = shape(
        num_kv_slots=600000, max_reqs=256, max_model_len=8192, max_prefill_tokens=16384
    )
    assert (n_dec, dec_prefix) == (2, [2048, 2048])
    assert prefills[0] == (1, 1023) and all(p == 0 for p, _ in prefills[1:])
    assert sum(e for _, e in prefills) == 16383 and max(p + e for p, e in prefills) == 1024
    # few rows: each as long as the model allows; the budget is cut to what the rows hold
    n_dec, dec_prefix, prefills = shape(
        num_kv_slots=600000, max_reqs=4, max_model_len=600, max_prefill_tokens=8192
    )
    assert dec_prefix == [598, 598] and len(prefills) == 2 and max(p + e for p, e in prefills) <= 598
    assert shape(num_kv_slots=600000, max_reqs=256, max_model_len=8192, max_prefill_tokens=2048) is None
    assert shape(num_kv_slots=2000, max_reqs=256, max_model_len=8192, max_prefill_tokens=16384) is None
    assert shape(num_kv_slots=600000, max_reqs=256, max_model_len=8192) is None


def test_a_steps_token_columns_start_16_byte_aligned_whatever_the_token_count(tiny):
    """Triton compiles a kernel variant per pointer alignment: positions and slots packed end to end
    behind an odd number of ids would change alignment with the step's token count."""
    _, runner = tiny
    pb = PlanBuilder(list(range(1000, 1100)))
    plan = pb.plan(
        [1, 2], [0, 0], [3, 4], list(range(7)), added=[seq_start(1, [1, 2, 3]), seq_start(2, [4] * 4)]
    )
    batch, sampled = runner._build_batch(plan)
    last_idx, sample_rows = sampled.logits, sampled.rows_t  # (token indices until the forward ran)
    cols = [batch.input_ids, batch.positions, batch.out_loc, batch.rows, last_idx, sample_rows]
    assert [t.data_ptr() % 16 for t in cols] == [0] * len(cols)
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3] and batch.out_loc.tolist() == plan.out_loc
    assert batch.rows.tolist() == [1, 2] and last_idx.tolist() == [2, 6]


def test_unsampled_prefill_chunk_returns_no_tokens_and_logprobs_only_when_asked(tiny):
    _, runner = tiny
    pb = PlanBuilder(list(range(500, 2000)))
    params = SamplingParams(temperature=0.0, logprobs=2)
    ids = list(range(10, 30))
    out = runner.execute(pb.plan([3], [0], [10], ids[:10], sample=[False], added=[seq_start(3, ids, params)]))
    assert out.rows == [] and out.tokens == [] and out.logprobs is None
    out = runner.execute(pb.plan([3, 4], [10, 0], [10, 2], ids[10:] + [7, 8], added=[seq_start(4, [7, 8])]))
    assert out.rows == [3, 4]
    assert len(out.logprobs) == 2 and out.logprobs[0] <= 0.0
    assert len(out.top_ids[0]) == 2 and out.top_ids[1] == [] and out.top_logprobs[1] == []
    assert out.top_ids[0][0] == out.tokens[0]  # greedy picks the top alternative
    out = runner.execute(pb.plan([4], [2], [1], [9], released=[3]))
    assert out.logprobs is None and 3 not in runner.sampler.rows


def test_prefix_slots_of_a_cached_prefix_are_reused(tiny):
    """A new request whose prefix KV already exists (radix hit) attends to those slots."""
    ref, runner = tiny
    pb = PlanBuilder(list(range(2000 - 300, 2000)))
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    plan = pb.plan([5], [0], [6], ids[:6], sample=[False], added=[seq_start(5, ids)])
    runner.execute(plan)
    start = SeqStart(
        row=6, params=SamplingParams(temperature=0.0), prompt_ids=ids, prefix_slots=plan.out_loc, stop_ids=[]
    )
    logits = runner.forward_logits(pb.plan([6], [6], [3], ids[6:], added=[start], released=[5]))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_runner_reports_eos_ids_and_kv_bytes(tiny):
    _, runner = tiny
    assert runner.eos_token_ids == [2]
    cfg = runner.config
    assert (
        runner.kv_pool.bytes_per_token
        == 2 * cfg.num_hidden_layers * 2 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )


def test_malformed_plan_is_a_clear_error(tiny):
    _, runner = tiny
    pb = PlanBuilder()
    plan = pb.plan([1], [0], [3], [5, 6])  # 2 ids for 3 new tokens
    with pytest.raises(ValueError, match="input_ids"):
        runner.execute(plan)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute(pb.plan([1], [127], [2], [5, 6]))


def test_fp8_kv_cache_halves_kv_bytes_and_stays_close_to_the_full_precision_cache(tmp_path):
    """--kv-cache-dtype fp8_e4m3: pools in e4m3 (scale 1), read back upcast. A prefix reused from the
    pool (second step) carries the rounding; logits stay near the float32-cache ones."""
    path = tmp_path / "m"
    save_tiny_llama(path, num_key_value_heads=2)
    runners = {
        kv: ModelRunner(
            RunnerConfig(str(path), num_kv_slots=512, max_reqs=4, max_model_len=128, kv_cache_dtype=kv)
        )
        for kv in ("auto", "fp8_e4m3")
    }
    assert runners["fp8_e4m3"].kv_pool.k[0].dtype == torch.float8_e4m3fn
    assert (
        runners["fp8_e4m3"].kv_pool.bytes_per_token * 4 == runners["auto"].kv_pool.bytes_per_token
    )  # vs float32
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    logits = {}
    for kv, runner in runners.items():
        pb = PlanBuilder()
        runner.forward_logits(pb.plan([1], [0], [6], ids[:6], added=[seq_start(1, ids)]))
        logits[kv] = runner.forward_logits(pb.plan([1], [6], [4], ids[6:]))
    diff = (logits["fp8_e4m3"] - logits["auto"]).abs().max().item()
    assert 0 < diff < 0.1 * logits["auto"].abs().max().item()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelRunner(
            RunnerConfig(str(path), num_kv_slots=64, max_reqs=2, max_model_len=32, kv_cache_dtype="int4")
        )

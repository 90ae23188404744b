"""DeepSeek-V4 prefix-cache hits through the paged pools, against a cold run of the same prompt (float32,
the tiny configs of the parity tests). Request A caches a prefix of H tokens; request B = that prefix +
its own tokens runs cold in one row and as a hit in another (a reused row: stale state from earlier
requests is in it), replaying the tokens [H - R, H) before the hit and then prefilling in two chunks
and decoding greedily. With R = H (exact mode) the hit equals the cold run. With R = the window
(bounded, the default) it is not bit-identical by design: window attention of the replayed tokens reads
nothing below H - R; once R covers the window's receptive field through every layer,
num_layers * (window - 1), it is exact again, because all that reaches later positions from below
H - R is the cached compressed entries. A hit never writes the cached prefix's entries."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from runtime.actors.scheduler.testing import run_scheduler, tokenized
from runtime.config import ServerConfig
from runtime.gpu.model_runner import ModelRunner, RunnerConfig
from runtime.gpu.testing import PagedPlanBuilder, random_prompt, save_tiny_deepseek_v4, seq_start

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIGS = {  # as in test_deepseek_v4_parity.py
    "v4": dict(),
    "wide_topk": dict(
        layer_types=[HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        num_hidden_layers=3,
        index_topk=64,
        sliding_window=5,
        hc_mult=3,
    ),
}
PAGE, SLOTS, H, DECODE = 8, 1024, 48, 8
EXACT_TOL = 1e-5


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_deepseek_v4(path, seed=5, **CONFIGS[request.param])


@pytest.fixture(scope="module")
def runner(model):
    cfg = RunnerConfig(str(model[0]), num_kv_slots=SLOTS, max_reqs=4, max_model_len=128, cpu_threads=1)
    return ModelRunner(cfg)


def every_position(runner, plan) -> torch.Tensor:
    runner._check_layout(plan)
    runner._update_table(plan)
    batch, _, _ = runner._build_batch(plan)
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch))


def prefill_and_decode(runner, pb, row, ids, hit, replay, prefix_slots=()):
    """Row `row` computes ids[hit:] after replaying the `replay` tokens before `hit`, in two chunks, then
    decodes DECODE greedy tokens. Returns the logits of positions hit.. and of the decodes, and the tokens."""
    start, mid = hit - replay, hit + (len(ids) - hit) // 2
    added = [seq_start(row, ids, prefix_slots=prefix_slots)]
    first = pb.plan(
        [row], [start], [mid - start], ids[start:mid], added=added, replay=[replay] if replay else []
    )
    logits = [every_position(runner, first)[replay:]]
    logits.append(every_position(runner, pb.plan([row], [mid], [len(ids) - mid], ids[mid:])))
    tokens = [int(logits[-1][-1].argmax())]
    for pos in range(len(ids), len(ids) + DECODE - 1):
        logits.append(runner.forward_logits(pb.plan([row], [pos], [1], tokens[-1:])))
        tokens.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), tokens


def cached_entries(runner, pb, row) -> dict[tuple[str, int], torch.Tensor]:
    """The pool entries of row's first H positions, per compressed layer."""
    cache, out = runner.kv_cache, {}
    for kind, pools in (("entries", cache.entries), ("index_keys", cache.index_keys)):
        for lid, pool in pools.items():
            rate = SLOTS // pool.shape[0]
            out[kind, lid] = pool[[pb.slot(row, p) // rate for p in range(0, H, rate)]].clone()
    return out


def hit_and_cold(runner, replay: int, seed: int):
    """(hit logits, cold logits) at positions >= H and the decodes, and the two greedy continuations."""
    prefix = random_prompt(H, seed)
    a, b = prefix + random_prompt(7, seed + 1), prefix + random_prompt(9, seed + 2)
    pb = PagedPlanBuilder(PAGE, SLOTS, seed)
    runner.execute(pb.plan([1], [0], [len(a)], a, added=[seq_start(1, a)]))  # request A caches the prefix
    before = cached_entries(runner, pb, 1)
    cold, cold_tokens = prefill_and_decode(runner, pb, 2, b, 0, 0)
    hit, hit_tokens = prefill_and_decode(runner, pb, 3, b, H, replay, pb.share(3, 1, H))
    after = cached_entries(runner, pb, 1)
    assert all(torch.equal(before[k], after[k]) for k in before), "a hit overwrote cached entries"
    return hit, cold[H:], hit_tokens, cold_tokens


@pytest.mark.parametrize("seed", [1])
def test_exact_replay_hit_equals_a_cold_run(runner, seed):
    hit, cold, hit_tokens, cold_tokens = hit_and_cold(runner, replay=H, seed=seed)
    torch.testing.assert_close(hit, cold, atol=EXACT_TOL, rtol=0)
    assert hit_tokens == cold_tokens


def test_bounded_replay_reads_nothing_below_h_minus_r(runner):
    cfg = runner.config
    window, field = cfg.sliding_window, cfg.num_hidden_layers * (cfg.sliding_window - 1)
    assert runner.prefix_replay == window  # the default bound
    hit, cold, _, _ = hit_and_cold(runner, replay=window, seed=3)
    assert (hit - cold).abs().max() > 1e-3  # not exact by design (figures in docs/deepseek_v4.md)
    hit, cold, hit_tokens, cold_tokens = hit_and_cold(runner, replay=field, seed=3)
    torch.testing.assert_close(hit, cold, atol=EXACT_TOL, rtol=0)  # the receptive field: exact again
    assert hit_tokens == cold_tokens


def greedy_reference(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation by use_cache=False full forwards (the parity tests' oracle)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(ids) :]


def test_scheduled_hits_retraction_and_row_reuse_match_transformers(model):
    """The real scheduler over a pool too small for the load (a request is retracted and re-admitted),
    with exact replay: requests sharing a 16-token prefix hit it once the first ones finish, rows are
    reused, and every greedy continuation equals transformers'."""
    path, ref = model
    cfg = RunnerConfig(str(path), num_kv_slots=96, max_reqs=3, max_model_len=128, cpu_threads=1)
    runner = ModelRunner(dataclasses.replace(cfg, swa_replay_exact=True))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 128, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 128, (3 + i,), generator=g).tolist() for i in range(4)]
    reqs = [tokenized(f"r{i}", p, 24) for i, p in enumerate(prompts)]
    cfg = ServerConfig(page_size=PAGE, max_total_tokens=96, max_running_requests=3, chunked_prefill_size=64)
    results, _ = asyncio.run(run_scheduler(cfg, reqs, runner=runner, max_model_len=128, timeout=300))
    assert not results.failed and results.stats.retractions > 0
    assert results.stats.swa_replay_tokens >= 2 * 16 and max(results.cached.values()) >= 16
    for r, p in zip(reqs, prompts, strict=True):
        assert results.tokens[r.rid] == greedy_reference(ref, p, 24), r.rid

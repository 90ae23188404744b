"""The KV-pool contract's two operations for what comes next, on each family's real pool: one request's
KV and state exported from one runner and imported into another runner's pool (other slots, another
row) continues exactly as the original does (prefill/decode disaggregation), and a request truncated by
its last tokens continues as if they had never been written (rejected draft tokens; V4 restores its
ring and tails from what `save_blocks` kept)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.kv_pool import request_kv_bytes, request_kv_from_bytes
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import (
    PagedPlanBuilder,
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_deepseek_v4,
    save_tiny_llama,
    seq_start,
)

PROMPT = 21  # not a multiple of V4's compression rates: an open window travels in the row state
FAMILIES = {
    "llama": lambda path: save_tiny_llama(path, num_key_value_heads=2),
    "deepseek_v3": lambda path: save_tiny_deepseek_v3(path),
    "deepseek_v4": lambda path: save_tiny_deepseek_v4(path),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    return request.param, path


def runner(path) -> ModelRunner:  # noqa: ANN001
    return ModelRunner(RunnerConfig(str(path), num_kv_slots=512, max_reqs=3, max_model_len=64, page_size=8))


def decode(
    r: ModelRunner, pb: PagedPlanBuilder, row: int, start: int, tokens: list[int], added=()
) -> torch.Tensor:  # noqa: ANN001
    """Logits of decoding `tokens` one by one in `row` from position `start`."""
    out = []
    for i, tok in enumerate(tokens):
        plan = pb.plan([row], [start + i], [1], [tok], added=added if i == 0 else ())
        out.append(r.forward_logits(plan)[0])
    return torch.stack(out)


def test_an_exported_request_continues_exactly_in_another_runner(checkpoint):
    family, path = checkpoint
    src, dst = runner(path), runner(path)
    ids = random_prompt(PROMPT, seed=1, vocab=src.vocab_size)
    follow = random_prompt(4, seed=2, vocab=src.vocab_size)
    pa, pb = PagedPlanBuilder(8, 512, seed=3), PagedPlanBuilder(8, 512, seed=4)
    src.execute(pa.plan([1], [0], [PROMPT], ids, added=[seq_start(1, ids)]))
    slots_a = torch.tensor([pa.slot(1, p) for p in range(PROMPT)])
    slots_b = [pb.slot(2, p) for p in range(PROMPT)]
    assert slots_a.tolist() != slots_b
    kv = request_kv_from_bytes(request_kv_bytes(src.kv_pool.export_request(1, slots_a)))  # as sent
    dst.kv_pool.import_request(2, torch.tensor(slots_b), kv)

    want = decode(src, pa, 1, PROMPT, follow)
    got = decode(dst, pb, 2, PROMPT, follow, added=[seq_start(2, ids, prefix_slots=slots_b)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (family == "deepseek_v4") == any(k.startswith("row.") for k in kv)


def test_an_import_that_does_not_fit_the_pool_is_refused(checkpoint):
    _, path = checkpoint
    src = runner(path)
    pb = PagedPlanBuilder(8, 512)
    ids = random_prompt(PROMPT, seed=1, vocab=src.vocab_size)
    src.execute(pb.plan([1], [0], [PROMPT], ids, added=[seq_start(1, ids)]))
    slots = torch.tensor([pb.slot(1, p) for p in range(PROMPT)])
    kv = src.kv_pool.export_request(1, slots)
    with pytest.raises(ValueError, match="does not fit|needs"):
        src.kv_pool.import_request(2, slots[:-8], kv)
    with pytest.raises(ValueError, match="needs"):
        src.kv_pool.import_request(2, slots, {k: v for k, v in list(kv.items())[1:]})


def test_a_truncated_request_continues_as_if_the_dropped_tokens_never_ran(checkpoint):
    family, path = checkpoint
    r, fresh = runner(path), runner(path)
    ids = random_prompt(PROMPT, seed=1, vocab=r.vocab_size)
    drafts, accepted = (
        random_prompt(3, seed=5, vocab=r.vocab_size),
        random_prompt(2, seed=6, vocab=r.vocab_size),
    )
    pb, pf = PagedPlanBuilder(8, 512, seed=3), PagedPlanBuilder(8, 512, seed=3)
    r.execute(pb.plan([1], [0], [PROMPT], ids, added=[seq_start(1, ids)]))
    fresh.execute(pf.plan([1], [0], [PROMPT], ids, added=[seq_start(1, ids)]))
    # per-row state written in place (V4's ring and tails) is saved before the drafts and restored after
    rows, first = torch.tensor([1]), torch.tensor([PROMPT])
    saved = r.kv_pool.save_blocks(rows, first, 3)
    assert (saved is None) == (family != "deepseek_v4")
    decode(r, pb, 1, PROMPT, drafts)  # three draft tokens written, then all rejected
    r.kv_pool.restore_rejected(saved, torch.tensor([0]))
    r.kv_pool.truncate(1, PROMPT + 3, 3)
    torch.testing.assert_close(decode(r, pb, 1, PROMPT, accepted), decode(fresh, pf, 1, PROMPT, accepted))

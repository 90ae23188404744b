"""The `sparse_attention` reference (kernels/sparse_attention) is DeepSeek-V4's attention: on the keys a
real V4 step selects (its sliding window and compressed entries, as `TorchV4Backend.forward_v4` hands
them to `attend_with_sink`) it gives attend_with_sink's output, through one source or split in two, and
on random selections it equals attend_with_sink over each token's gathered rows. CPU, float32."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.kernels.sparse_attention.reference import sparse_attention
from runtime.gpu.kernels.sparse_attention.testing import sparse_case
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4 import attention as v4_ref
from runtime.gpu.testing import PagedPlanBuilder, random_prompt, save_tiny_deepseek_v4, seq_start

TOL = 1e-5


@pytest.fixture(scope="module")
def v4_calls(tmp_path_factory) -> list[tuple]:
    """Every attend_with_sink call of a chunked prefill then 4 decode steps on a tiny V4 (sliding, CSA
    with indexer top-2, HCA, CSA; window 8), decode request by request (the batched decode path calls
    the op on pools directly: tests/unit/gpu/test_deepseek_v4_decode.py): (q, keys, mask, sinks,
    scale, out)."""
    path = tmp_path_factory.mktemp("v4")
    save_tiny_deepseek_v4(path, seed=5)
    runner = ModelRunner(
        RunnerConfig(str(path), num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1)
    )
    runner.attn.batched_decode = False
    calls, attend = [], v4_ref.attend_with_sink

    def record(q, kv, mask, sinks, scale):
        out = attend(q, kv, mask, sinks, scale)
        calls.append((q, kv, mask, sinks.detach(), scale, out))
        return out

    ids, pb = random_prompt(40, seed=3), PagedPlanBuilder(8)
    mp = pytest.MonkeyPatch()
    mp.setattr(v4_ref, "attend_with_sink", record)
    try:
        with torch.inference_mode():
            runner.forward_logits(pb.plan([1], [0], [21], ids[:21], added=[seq_start(1, ids)]))
            runner.forward_logits(pb.plan([1], [21], [15], ids[21:36]))
            for pos in range(36, 40):
                runner.forward_logits(pb.plan([1], [pos], [1], [ids[pos]]))
    finally:
        mp.undo()
    return calls


def test_v4_step_selection_as_indices_equals_attend_with_sink(v4_calls):
    compressed = 0
    for q, keys, mask, sinks, scale, want in v4_calls:
        compressed += keys.shape[0] > 8 + q.shape[0]  # window rows + this step's: the rest are entries
        got = sparse_attention(q, keys, v4_ref.selected_indices(mask), sinks, scale)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    assert len(v4_calls) == 6 * 4 and compressed > 0


def test_v4_step_selection_split_in_two_sources_equals_attend_with_sink(v4_calls):
    """The window and the entries as two pools (FlashMLA's extra_k_cache split), cut at any column."""
    g = torch.Generator().manual_seed(0)
    for q, keys, mask, sinks, scale, want in v4_calls:
        cut = int(torch.randint(0, keys.shape[0] + 1, (1,), generator=g))
        a, b = v4_ref.selected_indices(mask[:, :cut]), v4_ref.selected_indices(mask[:, cut:])
        got = sparse_attention(q, keys[:cut], a, sinks, scale, extra_kv=keys[cut:], extra_indices=b)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("two_sources", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_random_selection_equals_attend_with_sink_on_gathered_rows(two_sources, ragged):
    c = sparse_case(9, 4, 32, 6, 10, torch.float32, "cpu", prefix=3, two_sources=two_sources, ragged=ragged)
    c.indices[4] = -1  # a token with no window row
    got = sparse_attention(*c.args(), **c.kwargs())
    for t in range(9):
        idx = c.indices[t, : None if c.topk_length is None else int(c.topk_length[t])].long()
        rows = [c.kv[idx[idx >= 0]]]
        if two_sources:
            e = c.extra_indices[t].long()
            rows.append(c.extra_kv[e[e >= 0]])
        kv = torch.cat(rows)
        mask = torch.ones(1, kv.shape[0], dtype=torch.bool)
        want = v4_ref.attend_with_sink(c.q[t : t + 1], kv, mask, c.sinks, c.scale)
        torch.testing.assert_close(got[t : t + 1], want, atol=TOL, rtol=0)


def test_no_rows_and_no_sink_gives_zero():
    c = sparse_case(3, 4, 32, 4, 4, torch.float32, "cpu", prefix=10)
    c.indices[1] = -1
    out = sparse_attention(c.q, c.kv, c.indices, None, c.scale)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()

"""The `sparse_attention` reference (kernels/sparse_attention) is DeepSeek-V4's attention: on the index
lists a real V4 step hands it (`TorchV4Backend` request by request: the window's keys as one source, the
entry pool as the other, CSA's top-k lists and HCA's shared list cut per token by its length) it equals
the dense `attend_with_sink` over each token's named rows, and so it does on random selections. CPU,
float32."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.kernels.sparse_attention.reference import sparse_attention
from runtime.gpu.kernels.sparse_attention.testing import attend_with_sink, sparse_case
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4 import attention as v4_ref
from runtime.gpu.testing import PagedPlanBuilder, random_prompt, save_tiny_deepseek_v4, seq_start

TOL = 1e-5


class _Recorder:
    """Stands in for the op's registry handle in attention.py: runs the reference and keeps each call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get(self, device):
        return self.record

    def record(self, q, kv, indices, sinks, scale, out=None, **extra):
        got = sparse_attention(q, kv, indices, sinks, scale, out=out, **extra)
        kept = {k: v.clone() for k, v in extra.items()}
        self.calls.append(
            (q.clone(), kv.clone(), indices.clone(), sinks.detach().clone(), scale, kept, got.clone())
        )
        return got


@pytest.fixture(scope="module")
def v4_calls(tmp_path_factory) -> list[tuple]:
    """Every sparse_attention call of a chunked prefill then 4 decode steps on a tiny V4 (sliding, CSA
    with indexer top-2, HCA, CSA; window 8), decode request by request (the batched decode path calls
    the op on pools directly: tests/unit/gpu/test_deepseek_v4_decode.py)."""
    path = tmp_path_factory.mktemp("v4")
    save_tiny_deepseek_v4(path, seed=5)
    runner = ModelRunner(
        RunnerConfig(str(path), num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1)
    )
    runner.attn.batched_decode = False
    ids, pb, recorder = random_prompt(40, seed=3), PagedPlanBuilder(8), _Recorder()
    mp = pytest.MonkeyPatch()
    mp.setattr(v4_ref, "SPARSE_ATTENTION", recorder)
    try:
        with torch.inference_mode():
            runner.forward_logits(pb.plan([1], [0], [21], ids[:21], added=[seq_start(1, ids)]))
            runner.forward_logits(pb.plan([1], [21], [15], ids[21:36]))
            for pos in range(36, 40):
                runner.forward_logits(pb.plan([1], [pos], [1], [ids[pos]]))
    finally:
        mp.undo()
    return recorder.calls


def _named_rows(kv, indices, t, length=None) -> torch.Tensor:
    idx = indices[t, :length].long()
    return kv[idx[idx >= 0]]


def test_v4_step_index_lists_equal_attend_with_sink_on_the_named_rows(v4_calls):
    kinds = set()
    for q, kv, indices, sinks, scale, extra, got in v4_calls:
        if "extra_indices" in extra:
            kinds.add("hca" if "extra_topk_length" in extra else "csa")
        for t in range(q.shape[0]):
            rows = [_named_rows(kv, indices, t)]
            if extra:
                length = extra.get("extra_topk_length")
                cut = None if length is None else int(length[t])
                rows.append(_named_rows(extra["extra_kv"], extra["extra_indices"], t, cut))
            keys = torch.cat(rows)
            want = attend_with_sink(
                q[t : t + 1], keys, torch.ones(1, keys.shape[0], dtype=torch.bool), sinks, scale
            )
            torch.testing.assert_close(got[t : t + 1], want, atol=TOL, rtol=0)
    assert len(v4_calls) == 6 * 4 and kinds == {"csa", "hca"}


@pytest.mark.parametrize("two_sources", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_random_selection_equals_attend_with_sink_on_gathered_rows(two_sources, ragged):
    c = sparse_case(9, 4, 32, 6, 10, torch.float32, "cpu", prefix=3, two_sources=two_sources, ragged=ragged)
    c.indices[4] = -1  # a token with no window row
    got = sparse_attention(*c.args(), **c.kwargs())
    for t in range(9):
        rows = [_named_rows(c.kv, c.indices, t, None if c.topk_length is None else int(c.topk_length[t]))]
        if two_sources:
            rows.append(_named_rows(c.extra_kv, c.extra_indices, t))
        kv = torch.cat(rows)
        mask = torch.ones(1, kv.shape[0], dtype=torch.bool)
        want = attend_with_sink(c.q[t : t + 1], kv, mask, c.sinks, c.scale)
        torch.testing.assert_close(got[t : t + 1], want, atol=TOL, rtol=0)


def test_no_rows_and_no_sink_gives_zero():
    c = sparse_case(3, 4, 32, 4, 4, torch.float32, "cpu", prefix=10)
    c.indices[1] = -1
    out = sparse_attention(c.q, c.kv, c.indices, None, c.scale)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()

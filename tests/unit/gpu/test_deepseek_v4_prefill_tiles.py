"""DeepSeek-V4's request path (deepseek_v4/attention.py) in tiles as small as they go (3 queries a
sparse_attention call, 2 indexer entries scored at a time) computes what it computes in one tile per
request, on every step of the decode scenario run request by request (prefills of 2 to 31 tokens, a
mixed step, a prefix hit that replays, decode steps): the tiling changes no logit beyond float
rounding. CPU, float32."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4 import attention as v4_attention
from runtime.gpu.testing import V4_TINY_CONFIGS, save_tiny_deepseek_v4, v4_decode_scenario


@pytest.fixture(scope="module", params=sorted(V4_TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_deepseek_v4(path, seed=11, **V4_TINY_CONFIGS[request.param])
    return path


def _scenario(path, query_tile: int, entry_tile: int) -> tuple[list[torch.Tensor], list[int]]:
    """The scenario's logits, and the query count of every sparse_attention call."""
    cfg = RunnerConfig(str(path), num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1)
    runner = ModelRunner(cfg)
    runner.attn.batched_decode = False
    runner.attn.query_tile, runner.attn.entry_tile = query_tile, entry_tile
    sizes, op = [], v4_attention.SPARSE_ATTENTION

    class Recorder:
        @staticmethod
        def get(device):
            fn = op.get(device)
            return lambda q, *a, **k: sizes.append(q.shape[0]) or fn(q, *a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(v4_attention, "SPARSE_ATTENTION", Recorder)
    try:
        return v4_decode_scenario(runner), sizes
    finally:
        mp.undo()


def test_small_tiles_match_one_tile_per_request(checkpoint):
    want, whole = _scenario(checkpoint, 4096, 16384)
    got, tiled = _scenario(checkpoint, 3, 2)
    assert max(whole) == 31 and max(tiled) == 3 and sum(tiled) == sum(whole)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0, msg=lambda m, i=i: f"step {i}: {m}")

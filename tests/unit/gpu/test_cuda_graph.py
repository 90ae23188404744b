"""The decode-graph path (static buffers, padded buckets) computes what the plain path computes.

On the CPU the graph path runs eagerly over the same padded static buffers, so the padding and buffer
logic is checked here; tests/gpu/test_cuda_graph.py replays real CUDA graphs."""

from __future__ import annotations

import pytest

from runtime.config import RunnerConfig
from runtime.gpu.cuda_graph import graph_buckets
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import assert_same_decode, decode_scenario, save_tiny_llama


def test_buckets_cover_every_batch_size_up_to_the_max():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(256)[-3:] == [240, 248, 256]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, num_key_value_heads=2)
    return str(path)


def test_padded_static_buffer_decode_matches_plain_decode(tiny_path):
    cfg = RunnerConfig(tiny_path, num_kv_slots=1024, max_reqs=8, max_model_len=64)
    plain = ModelRunner(cfg)
    padded = ModelRunner(cfg)
    padded.graphs = padded.make_graphs(4, capture=False)  # buckets 1, 2, 4: 3 rows pad to 4
    assert_same_decode(decode_scenario(padded), decode_scenario(plain))


def test_graphs_are_off_on_cpu_and_when_disabled(tiny_path):
    assert ModelRunner(RunnerConfig(tiny_path, max_reqs=4, max_model_len=64)).graphs is None


def test_decode_graph_skips_mixed_and_unsampled_steps(tiny_path):
    runner = ModelRunner(RunnerConfig(tiny_path, num_kv_slots=256, max_reqs=4, max_model_len=64))
    graphs = runner.make_graphs(2, capture=False)
    from runtime.gpu.testing import PlanBuilder

    pb = PlanBuilder()
    assert graphs.fits(pb.plan([1, 2], [3, 3], [1, 1], [5, 6]))
    assert not graphs.fits(pb.plan([1, 2], [3, 3], [1, 2], [5, 6, 7]))
    assert not graphs.fits(pb.plan([1, 2], [3, 3], [1, 1], [5, 6], sample=[True, False]))
    assert not graphs.fits(pb.plan([1, 2, 3], [3, 3, 3], [1, 1, 1], [5, 6, 7]))
    graphs.enabled = False
    assert not graphs.fits(pb.plan([1], [3], [1], [5]))

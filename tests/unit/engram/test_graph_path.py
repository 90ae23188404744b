"""Engram on the decode-graph path: the step hashes its tokens on the device and gathers its rows there
(`EngramRuntime.graph_rows`), on the padded static buffers GraphRunner captures (run eagerly on the CPU),
and gives the logits and greedy tokens of the host path: addresses hashed as the scheduler hashes
them, decode rows completed with the sampled token on the lookup thread, rows from host shards over
the mailbox. SmolLM2 with an Engram block, and a tiny DeepSeek-V4 (4 mHC streams' gates)."""

from __future__ import annotations

import torch

from runtime.config import RunnerConfig
from runtime.engram.config import EngramOptions
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import copy_tokenizer, save_tiny_deepseek_v4
from runtime.gpu.testing.engram import engram_scenario
from runtime.gpu.warm_up import warm_up

BLOCK = {"n_embed_per_ngram": 32, "n_head_per_ngram": 4, "engram_vocab_size": [5003, 7001], "seed": 3}


def _compare(path, overrides: dict, vocab: int) -> None:
    kw = dict(num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1, hf_overrides=overrides)
    host = ModelRunner(RunnerConfig(str(path), engram=EngramOptions("host", shards=1), **kw))
    try:
        assert host.engram.wants_addresses and host.engram.on_device is None
        if host.attn.wants_warm_up:  # its made-up steps (run on CUDA only) hash without addresses
            warm_up(host.cfg, host.kv_pool.num_slots, host.forward_logits)
        want = engram_scenario(host, vocab)
    finally:
        host.engram.close()
    graphed = ModelRunner(RunnerConfig(str(path), engram=EngramOptions("device"), **kw))
    assert not graphed.engram.wants_addresses and graphed.capabilities().engram is False
    graphed.graphs = graphed.make_graphs(4, capture=False)  # buckets 1, 2, 4: 3 rows pad to 4
    runs = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda plan: runs.append(1) or run(plan)
    got = engram_scenario(graphed, vocab)
    assert len(runs) == 8  # every decode step took the graph path
    assert got[1] == want[1]
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")


def test_smollm2_engram_graph_path_matches_the_host_path(smollm2_path):
    _compare(smollm2_path, {"num_hidden_layers": 4, "engram": {**BLOCK, "layer_ids": [1, 3]}}, vocab=49152)


def test_deepseek_v4_engram_graph_path_matches_the_host_path(smollm2_path, tmp_path):
    save_tiny_deepseek_v4(tmp_path, seed=11, vocab_size=512, hc_mult=4)
    copy_tokenizer(smollm2_path, tmp_path)
    _compare(tmp_path, {"engram_layer_ids": [0, 2], "engram": BLOCK}, vocab=512)

"""Engram on the decode-graph path: the step hashes its tokens on the device and gathers its rows there
(`EngramRuntime.graph_rows`), on the padded static buffers GraphRunner captures (run eagerly on the CPU),
and gives the logits and greedy tokens of the host path: addresses hashed as the scheduler hashes
them, decode rows completed with the sampled token on the lookup thread, rows from host shards over
the mailbox. SmolLM2 with an Engram block, and a tiny DeepSeek-V4 (4 mHC streams' gates)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from runtime.config import RunnerConfig
from runtime.engram.config import EngramOptions
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import copy_tokenizer, save_tiny_deepseek_v4, seq_start
from runtime.gpu.testing.plans import plan_builder

BLOCK = {"n_embed_per_ngram": 32, "n_head_per_ngram": 4, "engram_vocab_size": [5003, 7001], "seed": 3}


def _scenario(runner: ModelRunner, vocab: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefills, decode steps whose batch shrinks and grows (padded buckets) mixing fed-back and explicit
    tokens, a mixed prefill + decode step, more decodes; each plan with the scheduler's addresses.
    Returns every step's sampled logits and tokens."""
    g = torch.Generator().manual_seed(0)
    hasher = runner.engram.hasher
    seqs = {r: torch.randint(3, vocab, (n,), generator=g).tolist() for r, n in ((1, 5), (2, 9), (3, 13))}
    kv = dict.fromkeys(seqs, 0)  # tokens in KV per row
    pb = plan_builder(runner)
    logits: list[torch.Tensor] = []
    sample = runner.sampler.sample
    runner.sampler.sample = lambda lg, *a, **k: logits.append(lg.float().clone()) or sample(lg, *a, **k)
    tokens = []

    def step(rows: list[int], use_last: list[bool], added=()) -> None:
        ext, ids, addr = [], [], []
        for r, last in zip(rows, use_last, strict=True):
            pos, n = kv[r], len(seqs[r]) - kv[r]
            ext.append(n)
            if last:  # the scheduler knows the predecessors; the worker completes the hash
                addr.append(hasher.partial(seqs[r], pos)[None])
            else:
                ids += seqs[r][pos:]
                addr.append(hasher.addresses(seqs[r], pos, n))
        plan = pb.plan(rows, [kv[r] for r in rows], ext, ids, use_last=use_last, added=added)
        plan = msgspec.structs.replace(plan, engram_addr=np.concatenate(addr).astype("<i8").tobytes())
        out = runner.execute(plan)
        tokens.append(out.tokens)
        for r, n, t in zip(rows, ext, out.tokens, strict=True):
            kv[r] += n
            seqs[r].append(t)

    step([1, 2, 3], [False] * 3, added=[seq_start(r, s) for r, s in seqs.items()])
    for i, rows in enumerate([[1, 2, 3], [1, 2, 3], [1, 3], [2], [1, 2, 3]]):
        use_last = [(r + i) % 2 == 0 for r in rows]
        for r, last in zip(rows, use_last, strict=True):
            if not last:  # an explicit input in place of the sampled token
                seqs[r][-1] = int(torch.randint(3, vocab, (1,), generator=g))
        step(rows, use_last)
    seqs[4], kv[4] = torch.randint(3, vocab, (6,), generator=g).tolist(), 0
    step([1, 2, 3, 4], [True, True, True, False], added=[seq_start(4, seqs[4])])
    for _ in range(3):
        step([1, 2, 3, 4], [True] * 4)
    return logits, tokens


def _compare(path, overrides: dict, vocab: int) -> None:
    kw = dict(num_kv_slots=1024, max_reqs=4, max_model_len=128, cpu_threads=1, hf_overrides=overrides)
    host = ModelRunner(RunnerConfig(str(path), engram=EngramOptions("host", shards=1), **kw))
    try:
        assert host.engram.wants_addresses and host.engram.on_device is None
        want = _scenario(host, vocab)
    finally:
        host.engram.close()
    graphed = ModelRunner(RunnerConfig(str(path), engram=EngramOptions("device"), **kw))
    assert not graphed.engram.wants_addresses and graphed.capabilities().engram is False
    graphed.graphs = graphed.make_graphs(4, capture=False)  # buckets 1, 2, 4: 3 rows pad to 4
    runs = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda plan: runs.append(1) or run(plan)
    got = _scenario(graphed, vocab)
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


@pytest.fixture(autouse=True)
def _float32_matmuls():
    torch.set_num_threads(1)

"""Engram on the GPU: the mapped host table (shared memory the shards fill, registered with
cudaHostRegister and read by kernels over PCIe) gives the device table's rows bit for bit; decode with
Engram under replayed CUDA graphs (device and mapped host tables, hashed on the device) gives the tokens
and logits of the eager host path (scheduler addresses, shards over the mailbox); a graph decode step
with Engram never waits on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.config import RunnerConfig
from runtime.engram.config import EngramConfig, EngramOptions
from runtime.engram.hashing import NgramHasher
from runtime.engram.host import HostPlacement
from runtime.engram.placement import DevicePlacement
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import decode_step_without_syncs, save_tiny_llama
from runtime.gpu.testing.engram import engram_scenario, save_word_tokenizer

pytestmark = pytest.mark.gpu

VOCAB = 512
BLOCK = {"layer_ids": [0, 2], "n_embed_per_ngram": 64, "n_head_per_ngram": 4,
         "engram_vocab_size": [50_021, 70_001], "seed": 3}  # fmt: skip


def test_mapped_host_table_rows_equal_the_device_table():
    cfg = EngramConfig(
        layer_ids=(1, 15), n_embed_per_ngram=512, n_head_per_ngram=8, engram_vocab_size=(64_601, 64_601)
    )
    hasher = NgramHasher(cfg, np.arange(129280) % 100_000)
    cuda = torch.device("cuda")
    device = DevicePlacement(cfg, hasher, cuda, torch.bfloat16)
    host = HostPlacement(cfg, hasher, cuda, torch.bfloat16, shards=3)
    try:
        assert host.mapped and host.device_table.is_cuda
        ids = np.random.default_rng(0).integers(0, 129280, size=4096)
        addr = torch.from_numpy(hasher.addresses(ids, 0, len(ids))).cuda()
        torch.testing.assert_close(host.device_table[addr], device.table[addr], rtol=0, atol=0)
        torch.testing.assert_close(
            host.device_table[-5:], device.table[-5:], rtol=0, atol=0
        )  # the last shard's
    finally:
        host.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-engram")
    save_tiny_llama(path, num_key_value_heads=2, vocab_size=VOCAB, num_hidden_layers=3)
    save_word_tokenizer(path, VOCAB)
    return str(path)


def _runner(path: str, opts: EngramOptions, graphs: bool) -> ModelRunner:
    return ModelRunner(RunnerConfig(
        path, device="cuda", dtype="float32", num_kv_slots=1024, max_reqs=4, max_model_len=64,
        cuda_graph=graphs, cuda_graph_max_bs=4, hf_overrides={"engram": BLOCK}, engram=opts,
    ))  # fmt: skip


@pytest.mark.parametrize("placement", ["device", "host"])
def test_graph_decode_with_engram_matches_the_eager_host_path(tiny_path, placement):
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _runner(tiny_path, EngramOptions("host", shards=2, mapped=False), graphs=False)
    try:
        assert eager.graphs is None and eager.engram.wants_addresses
        ref_logits, ref_tokens = engram_scenario(eager, VOCAB)
    finally:
        eager.engram.close()
    graphed = _runner(tiny_path, EngramOptions(placement, shards=2), graphs=True)
    try:
        assert graphed.graphs is not None and graphed.engram.on_device is not None
        replays = []
        run = graphed.graphs.run
        graphed.graphs.run = lambda plan: replays.append(1) or run(plan)
        logits, tokens = engram_scenario(graphed, VOCAB)
        assert len(replays) == 8
        assert tokens == ref_tokens
        for a, b in zip(logits, ref_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=0)
    finally:
        graphed.engram.close()


def test_graph_decode_step_with_mapped_engram_never_syncs(tiny_path):
    runner = _runner(tiny_path, EngramOptions("host", shards=2), graphs=True)
    try:
        decode_step_without_syncs(runner)
    finally:
        runner.engram.close()

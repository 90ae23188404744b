"""Decode through replayed CUDA graphs matches eager decode, and the decode loop never waits on the
device (only the runner's final copy of the tokens does)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import decode_scenario, decode_step_without_syncs, save_tiny_llama
from runtime.mailbox.messages import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, num_key_value_heads=2, vocab_size=512, num_hidden_layers=3)
    return str(path)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager_decode(tiny_path, backend, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(
        device="cuda", dtype=dtype, num_kv_slots=1024, max_reqs=8, max_model_len=64, attention_backend=backend
    )
    eager = ModelRunner(RunnerConfig(tiny_path, cuda_graph=False, **kw))
    graphed = ModelRunner(RunnerConfig(tiny_path, cuda_graph_max_bs=4, **kw))
    # one context bucket (max_model_len) for these backends: graphs keyed (batch, context)
    assert eager.graphs is None and sorted(graphed.graphs.graphs) == [(1, 64), (2, 64), (4, 64)]
    ref_logits, ref_tokens = decode_scenario(eager)
    logits, tokens = decode_scenario(graphed)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)
    if dtype == "float32":
        assert tokens == ref_tokens


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=50)]
)
def test_graph_decode_step_and_sampling_never_sync(tiny_path, params):
    runner = ModelRunner(
        RunnerConfig(tiny_path, device="cuda", num_kv_slots=512, max_reqs=4, max_model_len=64)
    )
    tokens = decode_step_without_syncs(runner, params)
    assert tokens.shape == (3,)

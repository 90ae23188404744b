"""On CUDA the KV pool takes what `mem_fraction_static` of the GPU's memory leaves after the weights."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import save_tiny_llama

pytestmark = pytest.mark.gpu


def test_the_pool_takes_what_the_memory_fraction_leaves(tmp_path):
    save_tiny_llama(tmp_path)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    fraction = 1 - (free / total) + 0.05  # 5% of the GPU for the pool and the tiny weights

    def runner(slots: int | None) -> ModelRunner:
        return ModelRunner(RunnerConfig(str(tmp_path), device="cuda", num_kv_slots=slots, mem_fraction_static=fraction,
                                        max_reqs=4, max_model_len=64, cuda_graph=False))  # fmt: skip

    assert runner(1000).kv_pool.num_slots == 1000  # a cap below what memory allows
    sized = runner(None).kv_pool
    pool = sized.num_slots * sized.bytes_per_token
    assert 0.9 * 0.05 * total < pool < 0.05 * total

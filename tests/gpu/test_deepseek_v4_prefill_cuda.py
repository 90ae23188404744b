"""DeepSeek-V4 prefill in tiles on CUDA (attention.py's request path: the `index_scores` and
`sparse_attention` kernels): a tiny V4's float32 prefill in tiles of 4 queries and 3 indexer entries
matches transformers' logits at every position; and at V4-Flash's indexer shapes the tiled top-k of a
4096-query tile over 32K entries (a 128K context) stays under 2.5 GB (about 1 GB expected), where the dense
selection's [tokens, heads, entries] float32 score tensor alone would take 32 GiB."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PagedPlanBuilder, random_prompt, save_tiny_deepseek_v4, seq_start

pytestmark = pytest.mark.gpu


def test_prefill_in_small_tiles_matches_transformers(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = save_tiny_deepseek_v4(tmp_path, seed=5).eval()
    runner = ModelRunner(RunnerConfig(str(tmp_path), device="cuda", dtype="float32", num_kv_slots=1024,
                                      max_reqs=4, max_model_len=256))  # fmt: skip
    runner.attn.query_tile, runner.attn.entry_tile = 4, 3
    ids = random_prompt(45, seed=1)
    logits = runner.token_logits(PagedPlanBuilder(8).plan([1], [0], [45], ids, added=[seq_start(1, ids)]))
    with torch.no_grad():
        expected = ref(torch.tensor([ids]), use_cache=False).logits[0].float()
    err = (logits.float().cpu() - expected).abs().max().item()
    assert err < 1e-4, f"max abs logit diff {err:.3g}"


def test_indexer_tile_at_v4_flash_shapes_stays_small():
    from runtime.gpu.models.deepseek_v4.compressor import Indexer
    from runtime.gpu.models.deepseek_v4.rope import InterleavedRope
    from runtime.gpu.presets import PRESETS
    from runtime.gpu.testing import tiny_deepseek_v4_config

    flash = PRESETS["deepseek-v4-flash"]
    keys = ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim", "index_topk")
    config = tiny_deepseek_v4_config(**{k: flash[k] for k in keys})
    indexer = Indexer(config).to("cuda", torch.bfloat16).eval()
    rope = InterleavedRope(config, "compress")
    tokens, entries = 4096, 32768
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, config.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    qr = torch.randn(tokens, config.q_lora_rank, generator=g, device="cuda").to(torch.bfloat16)
    index_keys = torch.randn(entries, config.index_head_dim, generator=g, device="cuda").to(torch.bfloat16)
    pos = torch.arange(4 * entries - tokens, 4 * entries, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        picked = indexer.select(x, qr, pos, index_keys, rope, 16384)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert picked.shape == (tokens, 512) and bool((picked >= 0).all())
    assert peak < 2.5e9, f"peak {peak / 1e9:.2f} GB"

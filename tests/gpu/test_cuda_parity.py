"""The runner on CUDA matches transformers: float32 almost exactly, bfloat16 within tolerance."""

from __future__ import annotations

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, prefill_then_decode, save_tiny_llama, seq_start
from runtime.mailbox.messages import SamplingParams

pytestmark = pytest.mark.gpu

# SmolLM2-135M's shapes (random weights: the GGUF does not travel to GPU machines).
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
LLAMA3 = dict(
    num_key_value_heads=2,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    ),
)


def reference(ref, seqs: list[list[int]], split: int) -> list[torch.Tensor]:
    with torch.no_grad():
        logits = ref(torch.tensor(seqs, device="cuda")).logits.float().cpu()
    return [x[split - 1 :] for x in logits]


@pytest.mark.parametrize("shape", ["tiny_llama3", "smollm2_shape"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_logits_match_transformers(tmp_path, shape, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = save_tiny_llama(tmp_path, **(LLAMA3 if shape == "tiny_llama3" else SMOLLM2_SHAPE)).cuda()
    runner = ModelRunner(
        RunnerConfig(
            str(tmp_path), device="cuda", dtype=dtype, num_kv_slots=4096, max_reqs=8, max_model_len=512
        )
    )
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, vocab, (3, 40), generator=g).tolist()
    ours, expected = list(prefill_then_decode(runner, seqs, split=32)), reference(ref, seqs, split=32)
    for a, b in zip(ours, expected, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
        else:
            scale = b.abs().max()
            assert (a - b).abs().max() < 0.05 * scale
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            assert cos.min() > 0.995


def test_cuda_seeded_sampling_is_reproducible_across_batches(tmp_path):
    save_tiny_llama(tmp_path, **LLAMA3)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    results = []
    for neighbours in (0, 3):
        runner = ModelRunner(
            RunnerConfig(str(tmp_path), device="cuda", num_kv_slots=1024, max_reqs=8, max_model_len=128)
        )
        pb = PlanBuilder()
        prompt = [5, 6, 7, 8]
        rows = [1] + list(range(2, 2 + neighbours))
        added = [seq_start(1, prompt, seeded)] + [
            seq_start(r, prompt, SamplingParams(temperature=1.0)) for r in rows[1:]
        ]
        out = runner.execute(pb.plan(rows, [0] * len(rows), [4] * len(rows), prompt * len(rows), added=added))
        toks = [out.tokens[0]]
        for i in range(8):
            n = len(rows)
            out = runner.execute(pb.plan(rows, [4 + i] * n, [1] * n, [], use_last=[True] * n))
            toks.append(out.tokens[0])
        results.append(toks)
    assert results[0] == results[1]


def test_cuda_fp8_kv_pages_of_64_match_pages_of_1(tmp_path):
    """--kv-cache-dtype fp8_e4m3 --page-size 64 at head dim 128: the decode kernel copies whole pages by
    TMA (a row's partial last page is gathered). The same prompts on a page-1 pool (every tile gathered)
    give the same logits, and both stay near transformers' bf16-cache logits."""
    from runtime.gpu.kernels.decode_attention import tilelang

    if not tilelang.available(torch.device("cuda")):
        pytest.skip("the TileLang fp8 decode kernel runs on Hopper")
    ref = save_tiny_llama(
        tmp_path, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        num_hidden_layers=2, **{k: v for k, v in LLAMA3.items() if k != "num_key_value_heads"},
    ).cuda()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    # 200 tokens: decode reads two whole pages, then a partial third; 70: one whole page and a tail
    seqs = torch.randint(3, ref.config.vocab_size, (3, 200), generator=g).tolist()
    logits = {}
    for page in (1, 64):
        runner = ModelRunner(
            RunnerConfig(
                str(tmp_path), device="cuda", kv_cache_dtype="fp8_e4m3", page_size=page, num_kv_slots=4096,
                max_reqs=8, max_model_len=512,
            )
        )  # fmt: skip
        logits[page] = prefill_then_decode(runner, seqs, split=70)
    torch.testing.assert_close(logits[64], logits[1], atol=1e-3, rtol=1e-3)
    expected = torch.stack(reference(ref, seqs, split=70))
    cos = torch.nn.functional.cosine_similarity(logits[64], expected, dim=-1)
    assert cos.min() > 0.99

"""DeepSeek-V3's decode step on the CUDA-graph path: with either MLA backend, the padded static-buffer
decode (what GraphRunner captures, run eagerly on the CPU) computes what plain decode with the
reference backend computes; "triton" picks the kernel backend (the `mla_decode` op; its reference here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v3.attention_kernel import MLAKernelBackend
from runtime.gpu.models.deepseek_v3.attention_ref import TorchMLABackend
from runtime.gpu.testing import (
    assert_same_decode,
    decode_scenario,
    prefill_then_decode,
    save_tiny_deepseek_v3,
    seq_start,
)
from runtime.gpu.testing.plans import plan_builder


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v3")
    save_tiny_deepseek_v3(path, seed=7)
    return str(path)


@pytest.fixture(scope="module")
def reference_run(tiny_path):
    runner = ModelRunner(RunnerConfig(tiny_path, num_kv_slots=1024, max_reqs=8, max_model_len=128))
    assert isinstance(runner.attn, TorchMLABackend)
    return decode_scenario(runner)


def _runner(path: str, backend: str, page_size: int = 1, kv_cache_dtype: str = "auto") -> ModelRunner:
    cfg = RunnerConfig(
        path, num_kv_slots=1024, max_reqs=8, max_model_len=128, attention_backend=backend, page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return ModelRunner(cfg)


def test_triton_name_picks_the_graph_capable_kernel_backend(tiny_path):
    backend = _runner(tiny_path, "triton").attn
    assert type(backend) is MLAKernelBackend and backend.supports_cuda_graph


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("graphs", [False, True])
def test_decode_matches_reference_backend(tiny_path, reference_run, backend, graphs):
    runner = _runner(tiny_path, backend)
    if graphs:  # buckets 1, 2, 4: 3 rows pad to 4; the mixed step runs eagerly
        runner.graphs = runner.make_graphs(4, capture=False)
    assert_same_decode(decode_scenario(runner), reference_run)


@pytest.mark.parametrize("graphs", [False, True])
def test_pages_of_whole_tiles_decode_through_a_page_table(tiny_path, reference_run, graphs):
    """Page size 64 (shuffled pages): the kernel backend hands `mla_decode` a 64-token page table
    derived on the device (on CUDA the TileLang kernel then loads whole tiles by TMA); same logits."""
    runner = _runner(tiny_path, "triton", page_size=64)
    if graphs:
        runner.graphs = runner.make_graphs(4, capture=False)
    assert_same_decode(decode_scenario(runner), reference_run)


@pytest.mark.parametrize(
    ("page_size", "pool_dtype", "want"),
    [
        (1, torch.bfloat16, "reference"),
        (64, torch.bfloat16, "flash_mla"),
        (128, torch.bfloat16, "flash_mla"),
        (64, torch.float8_e4m3fn, "reference"),
    ],
)
def test_flash_mla_serves_only_16_bit_pools_paged_in_whole_tiles(monkeypatch, page_size, pool_dtype, want):
    """FlashMLA's dense decode reads 16-bit 64-token pages: with a pool paged otherwise, or in e4m3, the
    backend takes the next choice (here the CPU's reference; the stand-in for FlashMLA is a
    distinguishable function)."""
    from runtime.gpu.kernels import registry
    from runtime.gpu.kernels.mla_decode import reference

    op = registry.op("mla_decode")
    impls = op.implementations()
    assert impls[0].name == "flash_mla"
    stand_in = dataclasses.replace(
        impls[0], available=lambda device: True, target="runtime.gpu.kernels.mla_decode.reference:pool_2d"
    )
    monkeypatch.setattr(op, "select", lambda device: stand_in)
    monkeypatch.setattr(op, "implementations", lambda: [stand_in, *impls[1:]])
    backend = MLAKernelBackend(4, 32, 8, 0.1, qk_nope_dim=16, v_dim=16)
    backend.page_size = page_size
    backend._bind(torch.device("cpu"), pool_dtype)
    chosen = {reference.pool_2d: "flash_mla", reference.mla_decode: "reference"}[backend.decode_fn]
    assert chosen == want


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_latent_cache_stays_close_to_the_full_precision_cache(tiny_path, backend):
    """--kv-cache-dtype fp8_e4m3 on the latent pool (scale 1): a quarter of the float32 pool's bytes,
    rows upcast wherever they are read: a chunk continuing a cached prefix (the expanded form), then
    decode steps (the absorbed form, through `mla_decode` with "triton"). The logits carry the rounding
    but stay near the float32 pool's."""
    runners = {kv: _runner(tiny_path, backend, kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}
    assert runners["fp8_e4m3"].kv_pool.kv[0].dtype == torch.float8_e4m3fn
    assert runners["fp8_e4m3"].kv_pool.bytes_per_token * 4 == runners["auto"].kv_pool.bytes_per_token
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, runners["auto"].vocab_size, (10,), generator=g).tolist()
    seqs = torch.randint(3, runners["auto"].vocab_size, (3, 12), generator=g).tolist()
    logits = {}
    for kv, runner in runners.items():
        pb = plan_builder(runner)
        runner.forward_logits(pb.plan([5], [0], [6], ids[:6], added=[seq_start(5, ids)]))
        chunk = runner.forward_logits(pb.plan([5], [6], [4], ids[6:])).float().cpu()
        logits[kv] = torch.cat([chunk.flatten(), prefill_then_decode(runner, seqs, 5).flatten()])
    diff = (logits["fp8_e4m3"] - logits["auto"]).abs().max().item()
    assert 0 < diff < 0.1 * logits["auto"].abs().max().item()


def test_fp8_latent_cache_decodes_the_same_through_graph_steps(tiny_path):
    """The padded static-buffer decode reads the e4m3 pool as plain decode does."""
    eager = _runner(tiny_path, "triton", kv_cache_dtype="fp8_e4m3")
    graphed = _runner(tiny_path, "triton", kv_cache_dtype="fp8_e4m3")
    graphed.graphs = graphed.make_graphs(4, capture=False)
    assert_same_decode(decode_scenario(graphed), decode_scenario(eager))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_absorbed_query_equals_the_concatenated_parts(dtype):
    """[q_nope W_UK | q_pe], with q_nope and q_pe slices of one projection output as the model passes
    them, the GEMM writing into the result's first columns."""
    from runtime.gpu.models.deepseek_v3.attention_kernel import absorbed_query

    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 48, generator=g).to(dtype)
    q_nope, q_pe = q[..., :32], q[..., 32:]
    w_uk = torch.randn(4, 32, 64, generator=g).to(dtype)
    want = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe], dim=-1)
    torch.testing.assert_close(absorbed_query(q_nope, q_pe, w_uk), want)


def test_balanced_routing_reaches_experts_as_uniform_routing_does(tiny_path):
    """`balance_routing` (loadgen steps on dummy weights): every token gets k distinct experts from the
    fixed table, the same on every call, and a step of many tokens reaches every expert about evenly."""
    from runtime.gpu.layers.moe import TopkRouter, balance_routing

    runner = ModelRunner(RunnerConfig(tiny_path, num_kv_slots=256, max_reqs=4, max_model_len=64,
                                      balanced_routing=True))  # fmt: skip
    routers = [m for m in runner.model.modules() if isinstance(m, TopkRouter)]
    assert routers and all(r.balanced is not None for r in routers)
    r = routers[0]
    x = torch.randn(512, r.weight.shape[1])
    weights, ids = r(x)
    assert ids.shape == weights.shape == (512, r.top_k)
    assert all(len(set(row)) == r.top_k for row in ids.tolist())
    counts = torch.bincount(ids.reshape(-1), minlength=r.num_experts).float()
    assert counts.min() > 0.5 * counts.mean()  # uniform: 512 x k pairs spread over every expert
    torch.testing.assert_close(r(x)[1], ids)
    assert torch.equal(r(x[:7])[1], ids[:7])
    assert balance_routing(torch.nn.Sequential(*routers)) == len(routers)

"""DeepSeek-V4 weights kept as the checkpoints store them (`--quantization fp8`): FP8 128 x 128 block-scaled
projections (`Fp8Linear`, the grouped o_a_proj, the merged shared experts) and packed FP4 routed experts
with UE8M0 scales per 32 (`fused_moe`'s FP4 path; on the CPU its reference). A random tiny V4 written as
an FP8 + FP4 checkpoint in the upstream layout (UE8M0 scales) and in transformers' (float32 FP8 scales,
stacked FP4 experts) computes what its dequantized float copy computes: the kept modules hold exactly the
dequantized values, so once the FP8 GEMMs' activation quantization is made exact (prefill rows go W8A8;
decode-sized ones W8A16, unquantized) only the float32 accumulation order differs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import RunnerConfig
from runtime.gpu.kernels import registry
from runtime.gpu.layers import MergedLinear
from runtime.gpu.layers.fp8_linear import Fp8GroupedLinear, Fp8Linear, MergedFp8Linear
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4.model import GroupedLinear
from runtime.gpu.quant import fp4, fp8
from runtime.gpu.testing import GREEDY, PlanBuilder, random_deepseek_v4, seq_start
from tests.unit.gpu.test_deepseek_v4_checkpoints import (
    UE8M0,
    quantize_hf,
    quantize_upstream,
    upstream_state,
    write_checkpoint,
)

FP8 = torch.float8_e4m3fn
# shared experts and o_a_proj's groups in whole 128-row blocks, as in V4-Flash (the tiny default is 32 / 16)
BLOCK_DIMS = dict(hidden_size=128, moe_intermediate_size=128, o_lora_rank=128)  # FP4 experts tileable
ALIGNED = list(range(512, 1024))  # slot = 512 + position for one row: whole, position-aligned pages
IDS = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()


def write_stored_checkpoints(root) -> dict:
    """A random tiny V4 (whole 128-row blocks, `expert_dtype: fp4`) as FP8 + FP4 checkpoints in 128 x 128
    blocks: {layout: (quantized checkpoint, its dequantized float copy)} for "upstream" and "hf"."""
    ref = random_deepseek_v4(seed=5, **BLOCK_DIMS)
    config = dict(ref.config.to_dict(), expert_dtype="fp4")
    hf = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    up_q, up_values = quantize_upstream(upstream_state(hf), fp8.BLOCK)
    hf_q, hf_values = quantize_hf(hf, fp8.BLOCK)
    quant = {"quant_method": "fp8", "weight_block_size": list(fp8.BLOCK)}
    out = {}
    for layout, q, values, qc in (
        ("upstream", up_q, up_values, dict(UE8M0, weight_block_size=list(fp8.BLOCK))),
        ("hf", hf_q, hf_values, quant),
    ):
        write_checkpoint(root / layout, q, dict(config, quantization_config=qc))
        write_checkpoint(root / f"{layout}_dequantized", values, config)
        out[layout] = root / layout, root / f"{layout}_dequantized"
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_stored_checkpoints(tmp_path_factory.mktemp("v4_stored"))


@pytest.fixture
def exact_activations(monkeypatch):
    """`fp8_linear`'s activation quantizer made exact (float values, unit scales)."""

    def exact(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        return x.float(), x.new_ones(x.shape[0], -(-x.shape[1] // group), dtype=torch.float32)

    monkeypatch.setattr("runtime.gpu.kernels.fp8_gemm.reference.fp8_act_quant", exact)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _runner(path, **kw) -> ModelRunner:
    kw = dict(num_kv_slots=1024, max_reqs=2, max_model_len=128, cpu_threads=1, **kw)
    return ModelRunner(RunnerConfig(str(path), **kw))


def _logits(runner: ModelRunner, ids: list[int], split: int = 20) -> torch.Tensor:
    """Prefill ids[:split] (every position's logits; 20 rows: W8A8), then decode the rest token by token."""
    pb = PlanBuilder(ALIGNED)
    out = [runner.token_logits(pb.plan([1], [0], [split], ids[:split], added=[seq_start(1, ids)]))]
    for pos in range(split, len(ids)):
        out.append(runner.forward_logits(pb.plan([1], [pos], [1], [ids[pos]])))
    return torch.cat(out)


def test_kept_modules_hold_the_checkpoint_bytes(checkpoints):
    path, _ = checkpoints["upstream"]
    model = _runner(path, quantization="fp8").model
    layer = model.model.layers[1]
    attn, moe = layer.self_attn, layer.mlp
    for m in (attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj, moe.shared_experts.down_proj):
        assert (
            isinstance(m, Fp8Linear) and m.weight.dtype == FP8 and m.weight_scale_inv.dtype == torch.float32
        )
    assert isinstance(attn.o_a_proj, Fp8GroupedLinear) and isinstance(
        moe.shared_experts.gate_up_proj, MergedFp8Linear
    )
    experts = moe.experts
    # tiled once loaded (`RoutedExperts.tile_fp4`): 16-row tiles of 128 k, the same bytes
    assert experts.weight_format == "fp4" and experts.gate_up_proj.shape == (4, 256 // 16, 1, 16, 64)
    assert experts.gate_up_proj.dtype == experts.gate_up_proj_scale_inv.dtype == torch.uint8
    assert fp4.stacked_shape(experts.down_proj_scale_inv) == (4, 128, 4)
    codes, scales = fp4.row_major(experts.gate_up_proj), fp4.row_major(experts.gate_up_proj_scale_inv)
    # the router, compressors, mHC, embedding and head stay float
    kept = (moe.gate, attn.compressor.kv_gate_proj, model.lm_head, model.model.embed_tokens)
    assert all(m.weight.dtype == torch.float32 for m in kept)
    ckpt = {}
    for f in sorted(path.glob("*.safetensors")):
        ckpt.update(load_file(f))
    up, up_scale = ckpt["layers.1.ffn.experts.2.w3.weight"], ckpt["layers.1.ffn.experts.2.w3.scale"]
    assert torch.equal(codes[2, 128:], up.view(torch.uint8))
    assert torch.equal(scales[2, 128:], up_scale.view(torch.uint8))
    wo_a = ckpt["layers.1.attn.wo_a.weight"]
    assert torch.equal(attn.o_a_proj.weight.view(torch.uint8), wo_a.view(torch.uint8))
    assert torch.equal(attn.o_a_proj.weight_scale_inv, ckpt["layers.1.attn.wo_a.scale"].float())


@pytest.mark.parametrize("layout", ["upstream", "hf"])
def test_kept_as_stored_logits_equal_the_dequantized_model(checkpoints, layout, exact_activations):
    path, dequantized = checkpoints[layout]
    kept = _logits(_runner(path, quantization="fp8"), IDS)
    torch.testing.assert_close(kept, _logits(_runner(dequantized), IDS), atol=1e-5, rtol=0)


def test_kept_as_stored_greedy_text_equals_the_dequantized_model(checkpoints):
    """8-token prompt and decode steps: every FP8 GEMM takes the W8A16 path (M <= 16), no activation
    rounding at all, so the greedy tokens agree with the float model's."""
    path, dequantized = checkpoints["upstream"]

    def generate(runner: ModelRunner) -> list[int]:
        pb, prompt = PlanBuilder(ALIGNED), IDS[:8]
        tokens = runner.execute(pb.plan([1], [0], [8], prompt, added=[seq_start(1, prompt, GREEDY)])).tokens
        for pos in range(8, 20):
            tokens += runner.execute(pb.plan([1], [pos], [1], [tokens[-1]])).tokens
        return tokens

    assert generate(_runner(path, quantization="fp8")) == generate(_runner(dequantized))


def test_quantization_none_dequantizes_and_float_checkpoints_quantize_at_load(checkpoints, exact_activations):
    """`none` keeps nothing; a float checkpoint under `fp8` quantizes each kept module at load. The float
    copy of the "hf" checkpoint (absmax float32 FP8 scales, as `--quantization fp8` quantizes) comes back
    to what that checkpoint holds, so the two compute the same (the upstream one's UE8M0 FP8 scales would
    not: a float checkpoint gets absmax scales)."""
    path, dequantized = checkpoints["hf"]
    none = _runner(path, quantization="none").model
    assert not any(isinstance(m, Fp8Linear) for m in none.modules())
    assert none.model.layers[1].mlp.experts.weight_format == "float"
    quantized_at_load = _runner(dequantized, quantization="fp8")
    experts = quantized_at_load.model.model.layers[2].mlp.experts
    assert experts.weight_format == "fp4"
    torch.testing.assert_close(
        _logits(quantized_at_load, IDS), _logits(_runner(path, quantization="fp8"), IDS), atol=1e-5, rtol=0
    )


def test_dummy_weights_are_made_in_the_stored_formats(checkpoints):
    """`--load-format dummy --quantization fp8`: FP8 projections and FP4 experts with real scales, a
    quarter of the float experts' bytes plus one scale byte per 32 weights."""
    path, _ = checkpoints["upstream"]
    runner = _runner(path, quantization="fp8", load_format="dummy")
    experts = runner.model.model.layers[3].mlp.experts
    assert experts.weight_format == "fp4"
    values = fp4.dequantize(
        fp4.row_major(experts.gate_up_proj.data), fp4.row_major(experts.gate_up_proj_scale_inv.data)
    )
    assert 0.01 < values.std().item() < 0.04  # normal(0, 0.02), e2m1-rounded
    expert_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    assert expert_bytes == experts.num_experts * experts.params_per_expert * (1 / 2 + 1 / 32)
    assert torch.isfinite(_logits(runner, IDS)).all()


def test_experts_without_fp4_in_the_config_stay_v3s_fp8_or_float():
    from runtime.gpu.models.deepseek_v4.model import DeepseekV4ForCausalLM

    config = random_deepseek_v4(seed=0, **BLOCK_DIMS).config
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, fp8_weights=True)
    assert model.model.layers[1].mlp.experts.weight_format == "fp8"
    config.moe_intermediate_size, config.o_lora_rank = 32, 16
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, fp8_weights=True)
    layer = model.model.layers[1]
    assert (
        layer.mlp.experts.weight_format == "float"
        and type(layer.mlp.shared_experts.gate_up_proj) is MergedLinear
    )
    assert type(layer.self_attn.o_a_proj) is GroupedLinear and isinstance(layer.self_attn.q_a_proj, Fp8Linear)


def test_loadgen_steps_times_dummy_v4_weights_as_stored(tmp_path, capsys):
    """`loadgen steps --quantization fp8` on a V4 with `expert_dtype: fp4`: dummy FP8 + FP4 weights, decode
    and prefill rows."""
    from loadgen.cli import main
    from runtime.gpu.testing import tiny_deepseek_v4_config

    tiny_deepseek_v4_config(**BLOCK_DIMS, expert_dtype="fp4").save_pretrained(tmp_path)
    args = ["steps", "--model-path", str(tmp_path), "--device", "cpu", "--batch-sizes", "2", "--context-len", "16",
            "--prefill-tokens", "16", "--steps", "1", "--warmup-steps", "0", "--page-size", "8",
            "--quantization", "fp8"]  # fmt: skip
    assert main(args) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "decode" in rows and "prefill" in rows

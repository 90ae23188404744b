"""`--quantization fp8`: DeepSeek-V2/V3 keep FP8 128 x 128 block-scaled weights and run FP8 GEMMs (on the
CPU the registry's float32 references of `fp8_act_quant`, `fp8_block_gemm` and FP8 `fused_moe`). The
only error against the dequantized model is the per-token activation quantization; `none` (and the CPU
default, `auto`) dequantize exactly as before."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.cli import build_parser, config_from_args
from runtime.config import RunnerConfig
from runtime.gpu.kernels import registry
from runtime.gpu.layers import MergedLinear
from runtime.gpu.layers.fp8_linear import Fp8Linear, MergedFp8Linear
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v3.model import DeepseekV3MLP
from runtime.gpu.quant import fp8
from runtime.gpu.testing import (
    GREEDY,
    PlanBuilder,
    assert_same_decode,
    decode_scenario,
    load_into_reference,
    reference_logits,
    save_tiny_deepseek_v2,
    save_tiny_deepseek_v3,
    save_tiny_llama,
    seq_start,
    tiny_deepseek_v3_config,
    write_fp8_checkpoint,
)

FP8 = torch.float8_e4m3fn
# gate|up parts and experts in whole 128-row blocks, as in the real models (the tiny default I is 96/32)
BLOCK_DIMS = dict(intermediate_size=128, moe_intermediate_size=128)
MODELS = {
    "v3": (save_tiny_deepseek_v3, dict()),  # q LoRA: q_a_proj / q_b_proj
    "v2_lite": (save_tiny_deepseek_v2, dict(q_lora_rank=None, topk_method="greedy")),  # q_proj
}
IDS = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def _runner(path, **kw) -> ModelRunner:
    kw = dict(num_kv_slots=512, max_reqs=4, max_model_len=128, cpu_threads=1, **kw)
    return ModelRunner(RunnerConfig(str(path), **kw))


def _logits(runner: ModelRunner, ids: list[int], split: int = 16) -> torch.Tensor:
    """Prefill ids[:split] (last position's logits), then decode the rest token by token."""
    pb = PlanBuilder()
    out = [runner.forward_logits(pb.plan([1], [0], [split], ids[:split], added=[seq_start(1, ids)]))[0]]
    for pos in range(split, len(ids)):
        out.append(runner.forward_logits(pb.plan([1], [pos], [1], [ids[pos]]))[0])
    return torch.stack(out)


@pytest.fixture
def exact_activations(monkeypatch):
    """The activation quantizers of `fp8_linear` and of the FP8 `fused_moe` reference made exact (float
    values, unit scales): what is left between the FP8 model and the float one holding the dequantized
    weights is float32 rounding, so any loading or layout mistake shows."""

    def exact(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        return x.float(), x.new_ones(x.shape[0], -(-x.shape[1] // group), dtype=torch.float32)

    monkeypatch.setattr("runtime.gpu.kernels.fp8_gemm.reference.fp8_act_quant", exact)
    monkeypatch.setattr("runtime.gpu.kernels.fused_moe.reference.act_quant", exact)
    registry.clear_cache()
    yield
    registry.clear_cache()


def _assert_within_activation_rounding(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """e4m3 activations (3 mantissa bits: up to 6% off per element) through three layers of a random
    tiny model: errors of a few percent of the logits' spread (measured: rms 2% for V3, 9% for V2-Lite
    whose softmax routing is scaled x16), far below the spread itself, same argmax mostly."""
    err, spread = (ours - expected).abs(), expected.std()
    assert err.pow(2).mean().sqrt() < 0.15 * spread, (err.pow(2).mean().sqrt(), spread)
    assert err.max() < 0.75 * spread, (err.max(), spread)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


@pytest.fixture(scope="module", params=sorted(MODELS))
def fp8_checkpoint(request, tmp_path_factory):
    """(float checkpoint, FP8 checkpoint in 128 x 128 blocks, transformers on the dequantized weights)."""
    root = tmp_path_factory.mktemp(request.param)
    build, overrides = MODELS[request.param]
    ref = build(root / "float", seed=3, **BLOCK_DIMS, **overrides)
    load_into_reference(ref, write_fp8_checkpoint(root / "float", root / "fp8", fp8.BLOCK))
    return root / "float", root / "fp8", ref


def test_fp8_checkpoint_modules_hold_its_e4m3_weights_and_scales(fp8_checkpoint):
    _, path, _ = fp8_checkpoint
    model = _runner(path, quantization="fp8").model
    dense, moe = model.model.layers[0], model.model.layers[1]
    attn = moe.self_attn
    q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    for m in (q, attn.kv_a_proj_with_mqa, attn.o_proj, dense.mlp.down_proj, moe.mlp.shared_experts.down_proj):
        assert isinstance(m, Fp8Linear) and m.weight.dtype == FP8
        assert m.weight_scale_inv.dtype == torch.float32
    assert isinstance(dense.mlp.gate_up_proj, MergedFp8Linear) and dense.mlp.gate_up_proj.weight.dtype == FP8
    assert dense.mlp.gate_up_proj.weight_scale_inv.shape == (2, 1)  # gate block, then up block
    experts = moe.mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj.dtype == FP8
    assert experts.gate_up_proj_scale_inv.shape == (8, 2, 1)
    assert experts.down_proj_scale_inv.shape == (8, 1, 1)
    # MLA's W_UK / W_UV, the router, the embedding and the head stay in the model dtype
    kept = (attn.kv_b_proj, moe.mlp.gate, model.lm_head, model.model.embed_tokens)
    assert all(m.weight.dtype == torch.float32 for m in kept)
    # the checkpoint's bytes, not a requantization: the merged gate|up and expert slices included
    ckpt = {}
    for f in sorted(path.glob("*.safetensors")):
        ckpt.update(load_file(f))
    prefix = "model.layers.1.self_attn." + ("q_proj" if attn.q_lora_rank is None else "q_b_proj")
    assert torch.equal(q.weight.view(torch.uint8), ckpt[f"{prefix}.weight"].view(torch.uint8))
    assert torch.equal(q.weight_scale_inv, ckpt[f"{prefix}.weight_scale_inv"])
    up = ckpt["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(dense.mlp.gate_up_proj.weight[128:].view(torch.uint8), up.view(torch.uint8))
    e5_up = ckpt["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    assert torch.equal(experts.gate_up_proj_scale_inv[5, 1:], e5_up)


def test_fp8_weights_logits_match_transformers_on_the_dequantized_model(fp8_checkpoint):
    _, path, ref = fp8_checkpoint
    expected = reference_logits(ref, IDS)[15:]
    _assert_within_activation_rounding(_logits(_runner(path, quantization="fp8"), IDS), expected)


def test_fp8_weights_with_exact_activations_equal_transformers(fp8_checkpoint, exact_activations):
    _, path, ref = fp8_checkpoint
    expected = reference_logits(ref, IDS)[15:]
    torch.testing.assert_close(_logits(_runner(path, quantization="fp8"), IDS), expected, atol=1e-5, rtol=0)


def test_fp8_weights_greedy_decode_mostly_agrees_with_transformers(fp8_checkpoint):
    """Our greedy pick at each decode step, fed transformers' greedy tokens so far (a random tiny model's
    near-tied logits would make free-running sequences part at the first flip)."""
    _, path, ref = fp8_checkpoint
    runner, prompt, n = _runner(path, quantization="fp8"), IDS[:8], 16
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    expected = out[0, 8:].tolist()
    pb = PlanBuilder()
    ours = runner.execute(pb.plan([1], [0], [8], prompt, added=[seq_start(1, prompt, GREEDY)])).tokens
    for pos in range(8, 8 + n - 1):
        ours += runner.execute(pb.plan([1], [pos], [1], [expected[pos - 8]])).tokens
    assert sum(a == b for a, b in zip(ours, expected, strict=True)) >= 0.75 * n, (ours, expected)


def test_fp8_weights_on_the_cuda_graph_path_match_plain_decode(fp8_checkpoint):
    """The padded static-buffer decode GraphRunner captures (run eagerly here): padding rows add
    activation rows to every FP8 GEMM and pairs to the experts, and change no real row."""
    _, path, _ = fp8_checkpoint
    cfg = dict(quantization="fp8", num_kv_slots=1024, max_reqs=8, max_model_len=64, cpu_threads=1)
    padded = ModelRunner(RunnerConfig(str(path), **cfg))
    padded.graphs = padded.make_graphs(4, capture=False)  # buckets 1, 2, 4: 3 rows pad to 4
    assert_same_decode(decode_scenario(padded), decode_scenario(ModelRunner(RunnerConfig(str(path), **cfg))))


def test_quantization_none_is_the_dequantizing_load_bit_for_bit(fp8_checkpoint):
    """`none` and the CPU default (`auto`) build the same float model from an FP8 checkpoint."""
    _, path, _ = fp8_checkpoint
    default, none = _runner(path), _runner(path, quantization="none")
    assert not any(isinstance(m, Fp8Linear) for m in none.model.modules())
    a, b = default.model.state_dict(), none.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float32 for t in b.values() if t.is_floating_point())
    assert torch.equal(_logits(default, IDS), _logits(none, IDS))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_float_weights_quantized_at_load_match_their_dequantized_values(
    fp8_checkpoint, load_format, exact_activations
):
    """A float checkpoint or dummy weights under `fp8`: each FP8 module is quantized at load, and the
    model computes what the float model holding the dequantized weights does (activation rounding
    aside, which the fixture turns off: dummy weights route near ties that it would flip)."""
    path, _, _ = fp8_checkpoint
    ours = _runner(path, quantization="fp8", load_format=load_format)
    twin = _runner(path, quantization="none", load_format=load_format)
    with torch.no_grad():
        for name, p in twin.model.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            src = ours.model.get_submodule(module_name)
            scale = getattr(src, leaf + fp8.SCALE_SUFFIX, None)
            w = getattr(src, leaf)
            p.copy_(w if scale is None else fp8.dequantize(w, scale, fp8.BLOCK))
    assert ours.model.model.layers[1].mlp.experts.gate_up_proj.dtype == FP8
    if load_format == "auto":  # the quantization is DeepSeek's: what the FP8 checkpoint writer stores
        q_float = load_file(path / "model.safetensors")["model.layers.2.self_attn.o_proj.weight"]
        q, s = fp8.quantize(q_float, fp8.BLOCK)
        o_proj = ours.model.model.layers[2].self_attn.o_proj
        assert torch.equal(o_proj.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(o_proj.weight_scale_inv, s)
    torch.testing.assert_close(_logits(ours, IDS), _logits(twin, IDS), atol=1e-5, rtol=0)


def test_fp8_checkpoint_in_other_blocks_is_requantized_to_the_kernels_blocks(fp8_checkpoint, tmp_path):
    """16 x 16 blocks (the GEMMs take 128 x 128): dequantized, then quantized again at load."""
    src, _, _ = fp8_checkpoint
    dequantized = write_fp8_checkpoint(src, tmp_path / "fp8_16", (16, 16))
    runner = _runner(tmp_path / "fp8_16", quantization="fp8")
    o_proj = runner.model.model.layers[2].self_attn.o_proj
    assert o_proj.weight.dtype == FP8 and o_proj.weight_scale_inv.shape == (1, 1)
    w = dequantized["model.layers.2.self_attn.o_proj.weight"]
    err = fp8.dequantize(o_proj.weight, o_proj.weight_scale_inv, fp8.BLOCK) - w
    assert err.abs().max() <= w.abs().max() * 2**-4  # within half an e4m3 step of the block's top binade


def test_auto_keeps_fp8_only_for_128_blocks_on_cuda():
    def config(block=None):
        q = None if block is None else {"quant_method": "fp8", "weight_block_size": list(block)}
        return type("Config", (), {"quantization_config": q})()

    assert fp8.keep_fp8("auto", config((128, 128)), "cuda")
    assert not fp8.keep_fp8("auto", config((128, 128)), "cpu")
    assert not fp8.keep_fp8("auto", config((16, 16)), "cuda")
    assert not fp8.keep_fp8("auto", config(), "cuda")
    assert fp8.keep_fp8("fp8", config(), "cpu") and not fp8.keep_fp8("none", config((128, 128)), "cuda")
    with pytest.raises(ValueError, match="unknown quantization"):
        fp8.keep_fp8("int8", config(), "cpu")


def test_quantization_fp8_on_a_model_without_fp8_weights_is_an_error(tmp_path):
    save_tiny_llama(tmp_path)
    _runner(tmp_path, quantization="auto")  # auto: nothing to keep, loads as before
    with pytest.raises(ValueError, match="--quantization fp8 is supported for DeepSeek-V2/V3"):
        _runner(tmp_path, quantization="fp8")


def test_merged_fp8_parts_must_fill_whole_blocks_else_the_mlp_stays_float():
    with pytest.raises(ValueError, match="multiples of the 128-row scale block"):
        MergedFp8Linear(64, [96, 96], ["gate_proj", "up_proj"])
    with torch.device("meta"):
        mlp = DeepseekV3MLP(64, 10944, fp8_weights=True)  # V2-Lite: 85.5 blocks of 128
    assert type(mlp.gate_up_proj) is MergedLinear and isinstance(mlp.down_proj, Fp8Linear)


def test_cli_quantization_flag_reaches_the_server_config():
    args = build_parser().parse_args(["serve", "--quantization", "fp8"])
    assert config_from_args(args).quantization == "fp8"
    assert config_from_args(build_parser().parse_args(["serve"])).quantization == "auto"


def test_loadgen_steps_times_dummy_fp8_weights(tmp_path, capsys):
    from loadgen.cli import main

    tiny_deepseek_v3_config(**BLOCK_DIMS).save_pretrained(tmp_path)
    args = ["steps", "--model-path", str(tmp_path), "--device", "cpu", "--batch-sizes", "2", "--context-len", "16",
            "--prefill-tokens", "16", "--steps", "1", "--warmup-steps", "1", "--quantization", "fp8"]  # fmt: skip
    assert main(args) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert "decode" in rows and "prefill" in rows

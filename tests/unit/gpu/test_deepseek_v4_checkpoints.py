"""DeepSeek-V4 checkpoint layouts load into the same model: Hugging Face names, upstream DeepSeek names
(the released checkpoints), FP8 e4m3 block-scaled weights and packed FP4 routed experts (UE8M0 or
float32 scales), each written as 2 safetensors shards with an index.

The layouts are written here from a transformers model's state dict by an inverse name table of this
file's own (not the loader's), so a wrong loader rule shows up as a missing tensor or a logit diff."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.models.deepseek_v4.weights import paired
from runtime.gpu.quant import fp4, fp8
from runtime.gpu.testing import PlanBuilder, random_deepseek_v4, seq_start

# HF name (after `model.layers.N.` / `model.`) -> upstream name
_TO_UPSTREAM = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.norm\.", "norm."),
    (r"^model\.layers\.", "layers."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]
# what the releases store in FP8 (the rest: bf16/float32 norms, compressors, router, hc, embed, head)
_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$"
)
UE8M0 = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}


def upstream_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> the released checkpoints' names (per-expert w1/w2/w3, int32 tid2eid)."""
    out = {}
    for name, t in hf.items():
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            for e in range(t.shape[0]):
                prefix = f"layers.{m[1]}.ffn.experts.{e}"
                if m[2] == "down_proj":
                    out[f"{prefix}.w2.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2)
                    out[f"{prefix}.w1.weight"], out[f"{prefix}.w3.weight"] = gate.clone(), up.clone()
            continue
        for pattern, repl in _TO_UPSTREAM:
            name = re.sub(pattern, repl, name)
        out[name] = t.to(torch.int32) if name.endswith("tid2eid") else t
    return out


def quantize_upstream(state: dict[str, torch.Tensor], block) -> tuple[dict, dict]:
    """FP8 (UE8M0 block scales) where the releases have it, FP4 routed experts; `X.scale` beside
    `X.weight`. Returns (checkpoint tensors, their dequantized float values by name)."""
    out, values = {}, {}
    for name, t in state.items():
        base = name.removesuffix(".weight")
        if _FP8.search(name):
            q, s = fp8.quantize(t, block, ue8m0=True)
            out[name], out[f"{base}.scale"] = q, s
            values[name] = fp8.dequantize(q, s, block)
        elif ".ffn.experts." in name:
            q, s = fp4.quantize(t)
            out[name], out[f"{base}.scale"] = q, s
            values[name] = fp4.dequantize(q, s)
        else:
            out[name] = values[name] = t
    return out, values


def quantize_hf(state: dict[str, torch.Tensor], block) -> tuple[dict, dict]:
    """transformers' FineGrainedFP8 serialization: `X.weight` e4m3 + float32 `X.weight_scale_inv` (the
    attention projections and shared experts);
    stacked experts packed FP4 `...experts.gate_up_proj` + UE8M0 `...experts.gate_up_proj_scale_inv`."""
    out, values = {}, {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            q, s = fp4.quantize(t)
            out[name], out[f"{name}_scale_inv"] = q, s
            values[name] = fp4.dequantize(q, s)
        elif re.search(
            r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight$|shared_experts\.", name
        ):
            q, s = fp8.quantize(t, block)
            out[name], out[name + "_scale_inv"] = q, s
            values[name] = fp8.dequantize(q, s, block)
        else:
            out[name] = values[name] = t
    return out, values


def write_checkpoint(path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """2 shards by alternating sorted names (so scales and weights often sit in different shards, some
    scales before their weights), an index, and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for file, keys in reversed(list(shards.items())):  # write the second shard first, as a loader may
        save_file({k: tensors[k].contiguous() for k in keys}, str(path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The same random tiny V4 (every layer kind, hash + learned MoE) in five layouts."""
    root = tmp_path_factory.mktemp("v4_layouts")
    ref = random_deepseek_v4(seed=7)
    config = ref.config.to_dict()
    hf = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    up = upstream_state(hf)
    up_q, up_values = quantize_upstream(up, (32, 32))
    hf_q, hf_values = quantize_hf(hf, (128, 128))
    quant_up = dict(config, quantization_config=dict(UE8M0, weight_block_size=[32, 32]), expert_dtype="fp4")
    quant_hf = dict(config, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    write_checkpoint(root / "hf", hf, config)
    write_checkpoint(root / "upstream", up, config)
    write_checkpoint(root / "upstream_fp8_fp4", up_q, quant_up)
    write_checkpoint(root / "upstream_dequantized", up_values, config)
    write_checkpoint(root / "hf_fp8_fp4", hf_q, quant_hf)
    write_checkpoint(root / "hf_dequantized", hf_values, config)
    return ref, root


ALIGNED = list(range(512, 1024))  # slot = 512 + position for one row: whole, position-aligned pages


def all_logits(path, ids: list[int]) -> torch.Tensor:
    """Our model from `path`: logits at every position of a one-shot prefill."""
    runner = ModelRunner(RunnerConfig(str(path), num_kv_slots=1024, max_reqs=2, max_model_len=128))
    plan = PlanBuilder(ALIGNED).plan([1], [0], [len(ids)], ids, added=[seq_start(1, ids)])
    return runner.token_logits(plan)


IDS = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def test_hf_named_float_checkpoint_matches_transformers(layouts):
    ref, root = layouts
    with torch.no_grad():
        expected = ref(torch.tensor([IDS]), use_cache=False).logits[0].float()
    torch.testing.assert_close(all_logits(root / "hf", IDS), expected, atol=1e-4, rtol=0)


def test_upstream_named_float_checkpoint_equals_hf_named(layouts):
    _, root = layouts
    torch.testing.assert_close(
        all_logits(root / "upstream", IDS), all_logits(root / "hf", IDS), atol=0, rtol=0
    )


@pytest.mark.parametrize("layout", ["upstream_fp8_fp4", "hf_fp8_fp4"])
def test_quantized_checkpoint_equals_its_dequantized_float_copy(layouts, layout):
    """FP8 (UE8M0 32x32 blocks / float32 128x128 blocks) and FP4 experts dequantize on load to exactly
    the values the float copy holds. Against the unquantized model the logits move by the quantization
    error: measured relative L2 0.24 (upstream) / 0.22 (hf) on this random 4-layer model, where FP4's
    one mantissa bit rounds Gaussian weights with ~12% relative RMS error (FP8 UE8M0: ~2.7%)."""
    _, root = layouts
    got = all_logits(root / layout, IDS)
    torch.testing.assert_close(
        got, all_logits(root / layout.replace("fp8_fp4", "dequantized"), IDS), atol=1e-5, rtol=0
    )
    unquantized = all_logits(root / "hf", IDS)
    rel = ((got - unquantized).norm() / unquantized.norm()).item()
    assert 1e-3 < rel < 0.5, rel


def test_fp4_unpacks_low_nibble_first_with_per_32_scales():
    packed = torch.tensor([[0x2F] * 16, [0x71] * 16], dtype=torch.uint8).view(
        torch.int8
    )  # [2, 16] -> [2, 32]
    scale = torch.tensor([[0.5], [4.0]]).to(torch.float8_e8m0fnu)
    w = fp4.dequantize(packed, scale)
    assert w.shape == (2, 32)
    assert w[0, :2].tolist() == [-3.0, 0.5]  # 0xF = -6 (low), 0x2 = 1 (high), times 0.5
    assert w[1, :2].tolist() == [2.0, 24.0]  # 0x1 = 0.5, 0x7 = 6, times 4


def test_fp4_round_trip_is_within_half_a_step():
    w = torch.randn(6, 64) * torch.logspace(-2, 1, 64)
    q, s = fp4.quantize(w)
    assert (
        q.dtype == torch.int8 and q.shape == (6, 32) and s.shape == (6, 2) and s.dtype == torch.float8_e8m0fnu
    )
    err = (fp4.dequantize(q, s) - w).abs().unflatten(-1, (2, 32))
    assert (err <= s.float().unsqueeze(-1) * 1.0 + 1e-7).all()  # e2m1 steps are at most 2 (between 4 and 6)


def test_orphan_quantized_weight_or_scale_is_an_error_but_a_plain_scale_parameter_passes():
    q, s = fp8.quantize(torch.randn(8, 8), (8, 8), ue8m0=True)
    with pytest.raises(ValueError, match="without a scale"):
        list(paired(iter([("a.weight", q)])))
    with pytest.raises(ValueError, match="scales without a weight"):
        list(paired(iter([("a.scale", s)])))
    hc_scale = torch.ones(3)  # transformers' `attn_hc.scale`: a parameter, no weight beside it
    assert [n for n, _, _ in paired(iter([("x.attn_hc.scale", hc_scale), ("x.w", hc_scale)]))] == [
        "x.w",
        "x.attn_hc.scale",
    ]

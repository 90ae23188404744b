"""DeepSeek-V4 checkpoints -> our (Hugging Face) parameter names, quantized weights kept or dequantized.

Layouts read, in any mix and any shard order:
- **Hugging Face** (transformers' `DeepseekV4ForCausalLM` state dict): `model.layers.N.self_attn.q_a_proj`,
  `...attn_hc.fn`, `model.hc_head.hc_fn`, stacked `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj`
  [E, D, I]. Quantized by transformers (FineGrainedFP8): `X.weight` + `X.weight_scale_inv`, stacked
  experts `X` + `X_scale_inv`.
- **Upstream DeepSeek** (the released checkpoints, the official `inference/model.py`): no `model.`
  prefix; `embed`, `head`, `norm`, `hc_head_{fn,base,scale}`; per layer `attn_norm`, `ffn_norm`,
  `hc_{attn,ffn}_{fn,base,scale}`, `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`,
  `attn.compressor.{wkv,wgate,ape,norm}`, `attn.indexer.{wq_b,weights_proj,compressor.*}`,
  `ffn.gate.{weight,bias,tid2eid}`, `ffn.experts.E.{w1,w2,w3}`, `ffn.shared_experts.{w1,w2,w3}`; the
  MTP block as `mtp.I.*` (`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`, `hc_head_*`, and a block).
  Quantized weights carry `X.scale` beside `X.weight`. transformers' `save_pretrained` writes these
  names too (with `model.` and its own `attn.norm` for `kv_norm`), which the same rules cover.

Quantization (V4-Flash: `quantization_config` fp8 e4m3, `scale_fmt: ue8m0`, blocks 128x128, and
`expert_dtype: fp4`): e4m3 weights with block scales (quant/fp8.py), packed e2m1 routed experts with
one scale per 32 along K (quant/fp4.py); scales UE8M0 (`float8_e8m0fnu`) or float32. The kind is read
off the weight's dtype (e4m3 -> FP8, int8 -> FP4), so one checkpoint may mix them. A quantized weight
whose destination keeps that format (`keep`: the model's FP8 projections under `--quantization`, its FP4
routed experts) streams on as stored, its scale beside it as `X.weight_scale_inv` (FP8 only in the
kernels' 128 x 128 blocks; FP4 scales as UE8M0 bytes); every other one is dequantized to float32 as it
streams by, like V3's, and the loader quantizes it again if its module is quantized."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch

from runtime.gpu.quant import fp4, fp8

Tensors = Iterator[tuple[str, torch.Tensor]]


def checkpoint_tensors(
    tensors: Tensors, config, num_layers: int, keep: Callable[[str, torch.Tensor], bool] = lambda n, t: False
) -> Tensors:
    """Any V4 layout -> tensors by our names, experts per expert (what deepseek_v3's `load_named` takes):
    quantized weights `keep(our name, weight)` accepts as stored, with their scales; the rest float."""
    block = fp8.block_size(config) or (128, 128)
    return stored_or_dequantized(per_expert(hf_names(paired(tensors), num_layers), block), block, keep)


# ---------------------------------------------------------------------------------------- quantization

Triples = Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]  # (name, tensor, its scale or None)


def _is_quantized(t: torch.Tensor) -> bool:
    return t.dtype == fp8.FP8 or fp4.is_packed(t)


def _dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    try:
        if fp4.is_packed(weight):
            return fp4.dequantize(weight, scale)
        return fp8.dequantize(weight, fp4.scale_values(scale), block)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def paired(tensors: Tensors) -> Triples:
    """Pair each quantized weight with its scale (`X.weight` + `X.scale`, or `X` + `X_scale_inv`), in
    any order across shards: (weight name, weight, scale); other tensors as (name, tensor, None).

    `X.scale` is also an ordinary parameter name (transformers' `attn_hc.scale`), so a `.scale` that
    no quantized `X.weight` claims by the end passes through unchanged; unpaired quantized weights and
    `_scale_inv` tensors are errors."""
    weights: dict[str, torch.Tensor] = {}  # quantized, waiting for their scale
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # weight name -> (scale name, scale)
    for name, t in tensors:
        if name.endswith("_scale_inv"):
            base = name.removesuffix("_scale_inv")
        elif name.endswith(".scale"):
            base = name.removesuffix(".scale") + ".weight"
        else:
            base = None
        if base is not None:
            if base in weights:
                yield base, weights.pop(base), t
            else:
                scales[base] = (name, t)
        elif _is_quantized(t):
            if name in scales:
                yield name, t, scales.pop(name)[1]
            else:
                weights[name] = t
        else:
            yield name, t, None
    orphans = []
    for scale_name, t in scales.values():
        if scale_name.endswith(".scale") and t.is_floating_point() and t.dtype != torch.float8_e8m0fnu:
            yield scale_name, t, None
        else:
            orphans.append(scale_name)
    if weights or orphans:
        raise ValueError(
            f"quantized checkpoint: weights without a scale {sorted(weights)[:5]}, scales without a "
            f"weight {sorted(orphans)[:5]}"
        )


def stored_or_dequantized(
    triples: Triples, block: tuple[int, int], keep: Callable[[str, torch.Tensor], bool]
) -> Tensors:
    """Kept quantized weights as (name, weight) then (name + `_scale_inv`, scale) in the form the model
    holds them (FP4: uint8 codes and UE8M0 bytes); other quantized weights dequantized; the rest as is."""
    for name, t, scale in triples:
        if scale is None:
            yield name, t
            continue
        if keep(name, t):
            if fp4.is_packed(t) and (bits := fp4.scale_bits(scale)) is not None:
                yield name, t.view(fp4.PACKED)
                yield name + fp8.SCALE_SUFFIX, bits
                continue
            if t.dtype == fp8.FP8 and block == fp8.BLOCK:
                yield name, t
                yield name + fp8.SCALE_SUFFIX, scale
                continue
        yield name, _dequantize(name, t, scale, block)


# ---------------------------------------------------------------------------------------- names

_ATTN_LEAVES = {
    "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj", "wo_b": "o_b_proj",
    "q_norm": "q_a_norm", "norm": "kv_norm", "attn_sink": "sinks", "ape": "position_bias", "wgate": "gate_proj",
}  # fmt: skip
_UPSTREAM = [
    (r"^embed\.", "embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]


def hf_name(name: str, num_layers: int) -> str | None:
    """Upstream or Hugging Face checkpoint name -> our (Hugging Face) parameter name; None to skip.
    MTP block i (`mtp.{i}.*`) is our `layers.{num_layers + i}`; its copies of embed/head are skipped."""
    name = name.removeprefix("model.")
    mtp = re.match(r"^mtp\.(\d+)\.(.*)$", name)
    if mtp:
        if mtp[2].startswith(("emb", "head")):
            return None
        name = f"layers.{num_layers + int(mtp[1])}.{mtp[2]}"
    for pattern, repl in _UPSTREAM:
        name = re.sub(pattern, repl, name)
    parts = name.split(".")
    if "self_attn" in parts:
        i = parts.index("self_attn")
        parts[i + 1 :] = [_ATTN_LEAVES.get(p, p) for p in parts[i + 1 :]]
    name = ".".join(parts)
    return name if name.startswith("lm_head.") else f"model.{name}"


def hf_names(triples: Triples, num_layers: int) -> Triples:
    for name, tensor, scale in triples:
        ours = hf_name(name, num_layers)
        if ours is not None:
            yield ours, tensor, scale


def per_expert(triples: Triples, block: tuple[int, int]) -> Triples:
    """Stacked `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] -> per-expert names.
    FP4 scales (one per row) split with their rows; stacked FP8 experts are dequantized first (their
    scale blocks may straddle gate and up)."""
    for name, tensor, scale in triples:
        m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", name)
        if not m:
            yield name, tensor, scale
            continue
        if scale is not None and not fp4.is_packed(tensor):
            tensor, scale = _dequantize(name, tensor, scale, block), None
        for e in range(tensor.shape[0]):
            s = None if scale is None else scale[e]
            if m[2] == "down_proj":
                yield f"{m[1]}.{e}.down_proj.weight", tensor[e], s
                continue
            gate, up = tensor[e].chunk(2, dim=0)
            s_gate, s_up = (None, None) if s is None else s.chunk(2, dim=0)
            yield f"{m[1]}.{e}.gate_proj.weight", gate, s_gate
            yield f"{m[1]}.{e}.up_proj.weight", up, s_up

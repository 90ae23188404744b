"""DeepSeek checkpoints (V2/V3, and V4 after its name mapping) into our models: by Hugging Face name,
routed experts into slices of their stacked weights, FP8 block-scaled weights into FP8 modules (and V4's
packed FP4 experts into FP4 experts)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import structlog
import torch
from torch import nn

from runtime.gpu import loader
from runtime.gpu.layers import MergedLinear
from runtime.gpu.layers.fp8_linear import MergedFp8Linear, load_float
from runtime.gpu.layers.moe import RoutedExperts
from runtime.gpu.quant import fp4, fp8

log = structlog.get_logger(__name__)

_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# a float tensor loaded into a quantized one (weight dtype -> how to quantize into it and its scale)
_QUANTIZE_INTO = {fp8.FP8: load_float, fp4.PACKED: fp4.load_float}


def load_deepseek_checkpoint(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """FP8 checkpoints: weights of FP8 modules stay FP8 when their blocks are the kernels' 128 x 128,
    every other FP8 weight is dequantized (and requantized by `load_named` if its module is FP8)."""
    block = fp8.block_size(model.config)
    if block:
        dtype_of = destination_dtype(model)
        tensors = fp8.dequantize_stream(
            tensors, block, lambda name: block == fp8.BLOCK and dtype_of(name) == fp8.FP8
        )
    load_named(model, tensors)


def destination_dtype(model: nn.Module) -> Callable[[str], torch.dtype | None]:
    """For a checkpoint weight name (ours): the dtype of the model tensor it fills (FP8, packed FP4 or a
    float), None when the model has none: whether a quantized weight can stay as stored."""
    params = dict(model.named_parameters())

    def dtype_of(name: str) -> torch.dtype | None:
        dst = _destination(model, params, name)
        return None if dst is None else dst[0].dtype

    return dtype_of


def load_named(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Checkpoint tensors by Hugging Face name into `model`. Expert tensors land in slices of the stacked
    expert weights; MTP layers' copies of the embedding and head are skipped (shared with the main
    model); MTP layers absent from the checkpoint are dropped. Anything else missing is an error.
    FP8 weights and their `weight_scale_inv` fill FP8 modules (packed FP4 ones FP4 experts); a float
    weight for a quantized module is quantized into its weight and scale."""
    params = dict(model.named_parameters())
    pending = {key for name in params for key in _keys_of(model, name)}
    first_mtp = model.model.num_layers
    mtp_keys = {k for k in pending if _layer_of(k[0]) >= first_mtp}
    unknown = []
    for name, tensor in tensors:
        if name.endswith(("rotary_emb.inv_freq", ".embed_tokens.weight", ".shared_head.head.weight")) and (
            _layer_of(name) >= first_mtp or name.endswith("inv_freq")
        ):
            continue
        found = _destination(model, params, name)
        if found is None:
            if not _other_ranks_expert(model, name):
                unknown.append(name)
            continue
        dst, key = found
        if dst.dtype in _QUANTIZE_INTO and tensor.dtype != dst.dtype:
            scale_dst, scale_key = _destination(model, params, name + fp8.SCALE_SUFFIX)
            _QUANTIZE_INTO[dst.dtype](dst, scale_dst, tensor)
            pending -= {key, scale_key}
            continue
        if getattr(_module_of(model, key[0]), "tp_padded", False):  # the last vocabulary part
            dst.zero_()
            dst = dst.narrow(0, 0, tensor.shape[0])
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor)
        pending.discard(key)
    if unknown:
        log.warning("checkpoint tensors not used by the model", names=unknown[:20], count=len(unknown))
    if mtp_keys and mtp_keys <= pending:
        log.info("checkpoint has no MTP layers; dropping them", count=len(model.mtp_layers))
        del model.model.layers[first_mtp:]
        pending -= mtp_keys
    pending = {k for k in pending if k[0] not in loader.optional_params(model)}
    if pending:
        missing = sorted(f"{n}[{s}]" if s else n for n, s in pending)
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:10]}")


def _destination(
    model: nn.Module, params: dict[str, nn.Parameter], name: str
) -> tuple[torch.Tensor, tuple[str, object]] | None:
    """The model tensor (a view: a merged part, an expert) that checkpoint tensor `name` (a weight or its
    `weight_scale_inv`) fills, and its key among `_keys_of`; None when the model has no such tensor."""
    scale = name.endswith(fp8.SCALE_SUFFIX)
    weight_name = name.removesuffix(fp8.SCALE_SUFFIX)
    m = _EXPERT_TENSOR.match(weight_name)
    if m:
        try:
            experts = model.get_submodule(m[1])
        except AttributeError:
            return None
        found = experts.checkpoint_slice(int(m[2]), m[3], scale)
        if found is None:
            return None
        return found[1], (f"{m[1]}.{found[0]}", (int(m[2]), m[3]))
    target, shard = _target(model, weight_name)
    target += fp8.SCALE_SUFFIX if scale else ""
    if target not in params:
        return None
    dst = params[target].data
    if shard is not None:
        merged = model.get_submodule(target.rpartition(".")[0])
        off, size = merged.shard_offset(shard, scale=True) if scale else merged.shard_offset(shard)
        dst = dst.narrow(0, off, size)
    return dst, (target, shard)


def _target(model: nn.Module, name: str) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, part of a merged linear or None), as `loader._target`,
    for float and FP8 merged linears."""
    module_name, _, leaf = name.rpartition(".")
    parent, _, child = module_name.rpartition(".")
    try:
        siblings = model.get_submodule(parent).named_children()
    except AttributeError:
        return name, None
    for merged_name, merged in siblings:
        if child in getattr(merged, "shard_names", ()):
            return f"{parent}.{merged_name}.{leaf}" if parent else f"{merged_name}.{leaf}", child
    return name, None


def _keys_of(model: nn.Module, param_name: str) -> list[tuple[str, object]]:
    """What must be loaded for one parameter: whole, per merged shard, or per (expert, part)."""
    module = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(module, RoutedExperts):
        leaf = param_name.rpartition(".")[2]
        parts = ("down_proj",) if leaf.startswith("down_proj") else ("gate_proj", "up_proj")
        return [(param_name, (e, p)) for e in module.logical_ids() for p in parts]
    if isinstance(module, (MergedLinear, MergedFp8Linear)):
        return [(param_name, s) for s in module.shard_names]
    return [(param_name, None)]


def _module_of(model: nn.Module, param_name: str) -> nn.Module | None:
    try:
        return model.get_submodule(param_name.rpartition(".")[0])
    except AttributeError:
        return None


def _other_ranks_expert(model: nn.Module, name: str) -> bool:
    """Whether `name` is a routed expert's tensor that another expert-parallel rank holds."""
    m = _EXPERT_TENSOR.match(name.removesuffix(fp8.SCALE_SUFFIX))
    if m is None:
        return False
    try:
        experts = model.get_submodule(m[1])
    except AttributeError:
        return False
    return int(m[2]) not in experts.logical_ids()


def skips_tensor(model: nn.Module, name: str) -> bool:
    """Checkpoint tensors this rank never reads (the experts other EP ranks hold)."""
    return _other_ranks_expert(model, name)


def _layer_of(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m[1]) if m else -1

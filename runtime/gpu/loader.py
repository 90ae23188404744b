"""Weights from a Hugging Face directory (config.json + safetensors, sharded or not) into our models.

Never downloads: a missing directory, file or tensor is a clear error."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
import torch
from torch import nn

from runtime.gpu.layers import MergedLinear

log = structlog.get_logger(__name__)

# Derived buffers some checkpoints carry; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_path: str | os.PathLike, overrides: dict | None = None):
    """The model's config; `model_path` is a Hugging Face directory or a preset name (runtime.gpu.presets).
    `overrides` (--hf-overrides) are merged into config.json before the config class reads it."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from runtime.config import apply_hf_overrides
    from runtime.gpu import presets

    path = Path(presets.resolve(str(model_path)))
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path} (Conduit never downloads models)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory?")
    if not overrides:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    data, _ = PretrainedConfig.get_config_dict(str(path), local_files_only=True)
    data = apply_hf_overrides(data, overrides)
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def safetensors_files(model_path: str | os.PathLike) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards named in {index.name} are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (GGUF? run `conduit convert` first)")
    return files


Slice = tuple[int, int, int]  # (dim, start, size) of a checkpoint tensor


def iter_tensors(
    files: list[Path],
    select: Callable[[str], Slice | None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors one at a time. With `select`, a tensor it names a slice of is read as that
    slice only (a tensor-parallel rank reads its part of each weight, never the whole checkpoint); a
    tensor `skip` names is not read at all (an expert-parallel rank skips other ranks' experts)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if skip is not None and skip(name):
                    continue
                part = select(name) if select is not None else None
                if part is None:
                    yield name, sf.get_tensor(name)
                    continue
                dim, start, size = part
                lazy = sf.get_slice(name)
                index = [slice(None)] * len(lazy.get_shape())
                index[dim] = slice(start, start + size)
                yield name, lazy[tuple(index)]


def checkpoint_slice(model: nn.Module, name: str) -> Slice | None:
    """The slice of checkpoint tensor `name` that `model` (one tensor-parallel rank) holds; None: all."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    target, shard = _target(model, name)
    module_name, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if shard is not None:
        rows = module.shard_source(shard)
        return None if rows is None else (0, *rows)
    return getattr(module, "tp_slices", {}).get(leaf)


def _target(model: nn.Module, name: str) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, shard inside a MergedLinear or None)."""
    module_name, _, leaf = name.rpartition(".")
    parent, _, child = module_name.rpartition(".")
    for merged_name, merged in _merged_children(model, parent):
        if child in merged.shard_names:
            return f"{parent}.{merged_name}.{leaf}" if parent else f"{merged_name}.{leaf}", child
    return name, None


def _merged_children(model: nn.Module, parent: str) -> list[tuple[str, MergedLinear]]:
    try:
        mod = model.get_submodule(parent) if parent else model
    except AttributeError:
        return []
    return [(n, m) for n, m in mod.named_children() if isinstance(m, MergedLinear)]


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model` by name; raise if any parameter stays unset."""
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    pending = {(n, s) for n, p in params.items() for s in _shards_of(model, n)}
    unknown = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        target, shard = _target(model, name)
        if target not in params:
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue  # tied: the embedding is the head
            unknown.append(name)
            continue
        dst = params[target].data
        module = model.get_submodule(target.rpartition(".")[0])
        if getattr(module, "tp_padded", False):  # the last vocabulary part: rows past V stay zero
            dst.zero_()
            dst = dst.narrow(0, 0, tensor.shape[0])
        if shard is not None:
            off, size = module.shard_offset(shard)
            dst = dst.narrow(0, off, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor)
        pending.discard((target, shard))
    if unknown:
        log.warning("checkpoint tensors not used by the model", names=unknown[:20], count=len(unknown))
    optional = optional_params(model)
    pending = {(n, s) for n, s in pending if n not in optional}
    if pending:
        missing = sorted(f"{n}[{s}]" if s else n for n, s in pending)
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:10]}")


def optional_params(model: nn.Module) -> set[str]:
    """Parameters a checkpoint may lack: those of modules marked `weights_optional` (the Engram add-on,
    which initialises itself from its seed before loading)."""
    return {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if getattr(module, "weights_optional", False)
        for name, _ in module.named_parameters()
    }


def _shards_of(model: nn.Module, param_name: str) -> list[str | None]:
    module = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(module, MergedLinear) and param_name.endswith(("weight", "bias")):
        return list(module.shard_names)
    return [None]


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for performance work: small normals, norms at one.

    Drawn on the parameters' own device (an 8B model takes seconds on a GPU, minutes on a CPU), so the
    values depend on the device; only the shapes matter here."""
    from runtime.gpu.layers import RMSNorm

    gens: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(seed)
        return gens[device]

    with torch.no_grad():
        for module in model.modules():
            params = list(module.parameters(recurse=False))
            if any(p.dtype.itemsize == 1 and p.dtype != torch.bool for p in params):
                # FP8 weights (Fp8Linear, FP8 experts), packed FP4 experts: the module draws floats and
                # quantizes them
                module.init_dummy(generator(params[0].device), std)
                continue
            for p in module.parameters(recurse=False):
                if (
                    not p.is_floating_point()
                ):  # index tables (V4's tid2eid): the model's own init_dummy_weights
                    continue
                if isinstance(module, RMSNorm):
                    p.fill_(1.0)
                    continue
                gen = generator(p.device)
                if p.device.type == "cpu":
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.normal_(0.0, std, generator=gen)

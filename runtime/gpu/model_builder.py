"""One rank's model, built and filled: its family's class, on the device, in the serving dtype, with
checkpoint (or dummy) weights, ready to serve."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import structlog
import torch

from runtime.config import RunnerConfig
from runtime.gpu import distributed, loader
from runtime.gpu.kernels.fp8_gemm.linear import precompile as precompile_fp8_gemms
from runtime.gpu.layers import RotaryEmbedding
from runtime.gpu.layers.fp8_linear import weight_shapes as fp8_weight_shapes
from runtime.gpu.models import CausalLM, get_model_class
from runtime.gpu.quant import fp8

log = structlog.get_logger(__name__)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return dtype
    if name in ("fp8_e4m3", "fp8"):
        return torch.float8_e4m3fn
    raise ValueError(f"unknown kv_cache_dtype {name!r} (auto, fp8_e4m3)")


def build_model(
    cfg: RunnerConfig,
    config,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,  # noqa: ANN001
) -> CausalLM:
    """Built on the meta device (no time goes into random init that loading overwrites), moved to
    `device` empty, then filled from the checkpoint at `path` or with dummy weights."""
    cls = get_model_class(config)
    with torch.device("meta"):
        model = cls(config, max_positions=cfg.max_model_len, **_quant_kwargs(cls, cfg, config, device))
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):  # derived tables: recompute (in float32) on the device
            m.build(device)
    if cfg.load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {cfg.load_format!r} (auto | dummy)")
    if cfg.load_format == "dummy":
        model.init_dummy_weights(cfg.seed)
    for m in model.modules():  # add-ons (Engram): from their seed, unless the checkpoint has them
        if getattr(m, "weights_optional", False):
            m.init_from_seed()
    if cfg.load_format == "auto":
        # a tensor-parallel rank reads only its slice of each weight it splits
        select = partial(loader.checkpoint_slice, model) if distributed.tp().size > 1 else None
        skip = model.skips_checkpoint_tensor if distributed.ep().size > 1 else None
        model.load_weights(loader.iter_tensors(loader.safetensors_files(path), select, skip))
    model.prepare_for_serving()
    _precompile_fp8_gemms(model, dtype, device)
    return model.eval().requires_grad_(False)


def _quant_kwargs(cls: type[CausalLM], cfg: RunnerConfig, config, device: torch.device) -> dict:  # noqa: ANN001
    """`fp8_weights=True` for a model that keeps FP8 weights under `quantization`."""
    mode = cfg.quantization
    fp8.check_quantization(mode)  # also for models that never keep FP8 weights
    if not cls.abilities.fp8_weights:
        if mode == "fp8":
            raise ValueError(f"--quantization fp8 is supported for DeepSeek-V2/V3/V4, not {cls.__name__}")
        return {}
    return {"fp8_weights": True} if fp8.keep_fp8(mode, config, device) else {}


def _precompile_fp8_gemms(model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    t0 = time.perf_counter()
    if lines := precompile_fp8_gemms(fp8_weight_shapes(model), dtype, device):
        failed = [ln for ln in lines if ln.startswith("FAILED")]
        log.info("fp8 GEMM kernels compiled", kernels=len(lines), seconds=round(time.perf_counter() - t0, 1))
        for line in failed:  # those shapes compile (or fail) on their first call instead
            log.warning("fp8 GEMM kernel did not compile", detail=line)

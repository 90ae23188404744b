"""The server's one typed config, built from the CLI in one place (runtime/cli.py) and shipped to child
processes as msgpack."""

from __future__ import annotations

from typing import Any

import msgspec


class ServerConfig(msgspec.Struct, kw_only=True):
    # model
    model: str | None = None  # HF directory; None = the embedded default (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model directory
    load_format: str = "auto"  # "auto" | "dummy" (random weights; `model` may then be a preset name)
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on cpu, bfloat16 on cuda
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8_e4m3"
    # DeepSeek-V2/V3 FP8 block weights: "auto" (kept for an FP8 checkpoint on CUDA) | "none" | "fp8"
    quantization: str = "auto"
    seed: int = 0
    # merged into the model's config.json before it is read (vLLM's --hf-overrides), e.g.
    # {"num_hidden_layers": 8} to fit a cut-down DeepSeek-V4-Flash preset on one GPU
    hf_overrides: dict[str, Any] | None = None
    # limits
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_running_requests: int = 128
    max_total_tokens: int | None = None  # KV pool size in token slots; default depends on device
    page_size: int = 1
    chunked_prefill_size: int | None = None  # default: by device memory (`resolved_chunked_prefill_size`)
    max_queued_requests: int = 4096
    # scheduling
    schedule_policy: str = "fcfs"
    disable_overlap: bool = False
    disable_radix_cache: bool = False
    # prefix hits on models with sliding-window state outside the pages (DeepSeek-V4): tokens before the
    # hit replayed to rebuild it (None: the model's sliding window), or replay from 0 (exact, for checks)
    swa_replay_tokens: int | None = None
    swa_replay_exact: bool = False
    # fast path
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # largest decode batch captured; default max_running_requests
    attention_backend: str | None = None  # default: triton on cuda, torch on cpu
    # serving
    host: str = "127.0.0.1"
    port: int = 30000
    placement: str = "multiprocess"  # "multiprocess" (frontend + engine process) | "single"

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")

    def resolved_chunked_prefill_size(self) -> int:
        """The step's token budget: as given, else SGLang's tiers by the GPU's memory (2048 under 35 GB,
        8192 under 160 GB, as on an H100 / H200, else 16384), and 2048 on the CPU."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        if not self.device.startswith("cuda"):
            return 2048
        import torch

        gib = torch.cuda.get_device_properties(torch.device(self.device)).total_memory / 2**30
        return 2048 if gib < 35 else 8192 if gib < 160 else 16384

    def resolved_kv_slots(self) -> int:
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return 262144 if self.device.startswith("cuda") else 32768


# Per-layer lists that must shrink with `num_hidden_layers` (V4's `compress_ratios` is cut by transformers).
_PER_LAYER_KEYS = ("layer_types", "mlp_layer_types")


def apply_hf_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json contents with `overrides` merged in (nested dicts key by key, like vLLM), before any
    config class sees them, so derived fields follow. Fewer `num_hidden_layers` keeps the first layers:
    per-layer lists are cut to the new count."""
    if not overrides:
        return config
    out = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    n = overrides.get("num_hidden_layers")
    if n is not None:
        for key in _PER_LAYER_KEYS:
            if isinstance(out.get(key), list) and key not in overrides:
                out[key] = out[key][:n]
    return out

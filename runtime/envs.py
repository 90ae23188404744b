"""Every environment variable Conduit reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: $CONDUIT_CACHE_DIR, else $XDG_CACHE_HOME/conduit, else ~/.cache/conduit."""
    if v := os.environ.get("CONDUIT_CACHE_DIR"):
        return Path(v)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "conduit"


def log_format() -> str:
    """`console` (default on a terminal) or `json` (production): $CONDUIT_LOG_FORMAT."""
    return os.environ.get("CONDUIT_LOG_FORMAT", "console")


def log_level() -> str:
    return os.environ.get("CONDUIT_LOG_LEVEL", "info")


def forced_kernel(op: str) -> str | None:
    """$CONDUIT_KERNEL_<OP>=name forces one implementation of a kernel op, for comparisons."""
    return os.environ.get(f"CONDUIT_KERNEL_{op.upper()}")


def fold_norms() -> bool:
    """$CONDUIT_FOLD_NORMS=0 keeps Llama's RMSNorm launches (the unfolded form), for before/after runs."""
    return os.environ.get("CONDUIT_FOLD_NORMS", "1") != "0"


def v4_cuda_graph() -> bool:
    """$CONDUIT_V4_CUDA_GRAPH=0 runs DeepSeek-V4's decode steps eagerly while other models keep their
    CUDA graphs (`--disable-cuda-graph` turns off all), for comparisons."""
    return os.environ.get("CONDUIT_V4_CUDA_GRAPH", "1") != "0"


def v4_batched_decode() -> bool:
    """$CONDUIT_V4_BATCHED_DECODE=0 sends DeepSeek-V4 decode steps request by request (attention/v4_ref.py)
    instead of every row at once (attention/v4_decode.py), for comparisons."""
    return os.environ.get("CONDUIT_V4_BATCHED_DECODE", "1") != "0"


def mixed_decode_kernel() -> bool:
    """$CONDUIT_MIXED_DECODE_KERNEL=0 sends a mixed step's decode rows through the extend kernel with its
    prefill rows (attention/triton_backend.py) instead of the decode kernel, for before/after runs."""
    return os.environ.get("CONDUIT_MIXED_DECODE_KERNEL", "1") != "0"


def decode_tma_pages() -> bool:
    """$CONDUIT_DECODE_TMA=0 has the fp8 decode kernel gather every tile token by token even when the pool's
    pages hold whole 64-token tiles (kernels/decode_attention/tilelang.py), for before/after runs."""
    return os.environ.get("CONDUIT_DECODE_TMA", "1") != "0"


def prefill_kernel() -> bool:
    """$CONDUIT_PREFILL_KERNEL=0 sends prefill rows through the extend kernel (every key gathered from the
    pool) instead of the prefill kernel (new keys read from the step's own k/v;
    attention/triton_backend.py), for before/after runs."""
    return os.environ.get("CONDUIT_PREFILL_KERNEL", "1") != "0"


def step_trace_path() -> str | None:
    """$CONDUIT_STEP_TRACE=file: the scheduler appends a JSON line per step (rows, decode rows, prefill
    tokens, device start and end), for finding where a benchmark's time goes."""
    return os.environ.get("CONDUIT_STEP_TRACE") or None

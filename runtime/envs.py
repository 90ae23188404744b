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


def fp4_moe_step() -> str | None:
    """$CONDUIT_FP4_MOE_STEP=form forces the FP4 experts' K-step form (`fused_moe.triton_fp4.FP4_STEPS`)
    over `choose_config`'s pick, for comparisons in one call."""
    return os.environ.get("CONDUIT_FP4_MOE_STEP") or None


def fp4_moe_decode_tile() -> tuple[int, ...] | None:
    """$CONDUIT_FP4_MOE_DECODE_TILE=block_m,block_n,block_k,warps,stages forces the FP4 experts' tile at
    decode and verify sizes (up to 16 rows an expert) over `choose_config`'s, for comparing tiles in
    whole steps (`benchmarks/device/v4_fp4_forms.sh`)."""
    tile = os.environ.get("CONDUIT_FP4_MOE_DECODE_TILE")
    if not tile:
        return None
    values = tuple(int(v) for v in tile.split(","))
    if len(values) != 5:
        raise ValueError(f"CONDUIT_FP4_MOE_DECODE_TILE={tile}: want block_m,block_n,block_k,warps,stages")
    return values


def step_trace_path() -> str | None:
    """$CONDUIT_STEP_TRACE=file: the scheduler appends a JSON line per step (rows, decode rows, prefill
    tokens, device start and end), for finding where a benchmark's time goes."""
    return os.environ.get("CONDUIT_STEP_TRACE") or None


def injected_fault(actor: str) -> str | None:
    """$CONDUIT_FAULT_INJECT="tokenizer=MARK,detokenizer=MARK": for fault-injection tests, that actor
    crashes on a request whose prompt contains MARK (the tokenizer when it receives it, the detokenizer at
    its first output tokens, from the prompt's last tokens it is given). Unset in production."""
    for item in os.environ.get("CONDUIT_FAULT_INJECT", "").split(","):
        name, _, mark = item.partition("=")
        if name.strip() == actor and mark:
            return mark
    return None

"""Engram table rows: generated from the seed, or read from a safetensors file, by global row range.

Generated rows are drawn in blocks of `BLOCK` rows, each from its own generator, so a shard that owns
rows [a, b) draws exactly the values the whole table has there. A file holds one tensor per layer,
`engram.{layer}.table` [that layer's rows, head_dim], its tables in (order, head) order (the reference's
`nn.Embedding` layout)."""

from __future__ import annotations

import torch

from runtime.engram.config import EngramConfig

BLOCK = 1 << 16


def generate_rows(seed: int, start: int, stop: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, stop) of the seeded table: standard normals, as `nn.Embedding` initialises."""
    out = torch.empty(stop - start, dim, dtype=dtype)
    for b in range(start // BLOCK, (stop + BLOCK - 1) // BLOCK if stop > start else start // BLOCK):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        g = torch.Generator().manual_seed((seed + 1) * 7_919_317 + b)
        block = torch.randn(BLOCK, dim, generator=g)
        a, z = max(lo, start), min(hi, stop)
        out[a - start : z - start] = block[a - lo : z - lo].to(dtype)
    return out


def load_rows(
    cfg: EngramConfig, layer_rows: dict[int, tuple[int, int]], start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows [start, stop) of the global row space, from `cfg.tables_path` or the seed; `layer_rows`:
    each layer's global row range (`NgramHasher.layer_ranges`)."""
    if cfg.tables_path is None:
        return generate_rows(cfg.seed, start, stop, cfg.head_dim, dtype)
    from safetensors import safe_open

    parts = []
    with safe_open(cfg.tables_path, framework="pt") as f:
        for layer in cfg.layer_ids:
            lo, hi = layer_rows[layer]
            a, z = max(lo, start), min(hi, stop)
            if a < z:
                parts.append(f.get_slice(f"engram.{layer}.table")[a - lo : z - lo].to(dtype))
    return torch.cat(parts) if parts else torch.empty(0, cfg.head_dim, dtype=dtype)


def shard_ranges(total: int, shards: int) -> list[tuple[int, int]]:
    """`shards` contiguous row ranges covering [0, total), as even as can be."""
    bounds = [total * i // shards for i in range(shards + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))

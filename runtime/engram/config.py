"""The Engram block of a model's config.json (or `--hf-overrides`), in the reference's field names.

    "engram": {"layer_ids": [1, 15], "max_ngram_size": 3, "n_embed_per_ngram": 512,
               "n_head_per_ngram": 8, "engram_vocab_size": [646400, 646400], "kernel_size": 4,
               "pad_id": 2, "seed": 0}

DeepSeek-V4.1 names its Engram layers in a top-level `engram_layer_ids`, which wins over the block's
`layer_ids`. A config without either has no Engram."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_VOCAB = 129280 * 5  # the reference's per-order table size (DeepSeek-V3 vocabulary * 5)


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...]
    max_ngram_size: int = 3
    n_embed_per_ngram: int = 512
    n_head_per_ngram: int = 8
    engram_vocab_size: tuple[int, ...] = (DEFAULT_VOCAB, DEFAULT_VOCAB)
    kernel_size: int = 4
    pad_id: int = 2
    seed: int = 0
    # where the tables come from: a safetensors file with one tensor `engram.{layer}.table` per layer,
    # or None: generated from `seed`
    tables_path: str | None = None

    def __post_init__(self) -> None:
        if len(self.engram_vocab_size) != self.max_ngram_size - 1:
            raise ValueError(
                f"engram_vocab_size needs one size per n-gram order 2..{self.max_ngram_size}, "
                f"got {list(self.engram_vocab_size)}"
            )
        if self.n_embed_per_ngram % self.n_head_per_ngram:
            raise ValueError("n_embed_per_ngram must be a multiple of n_head_per_ngram")

    @property
    def head_dim(self) -> int:
        """Width of one head's table row."""
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def heads_per_layer(self) -> int:
        """Tables per layer: one per (order, head)."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    @property
    def hidden(self) -> int:
        """Width of a token's concatenated lookups, (N - 1) * n_embed_per_ngram."""
        return (self.max_ngram_size - 1) * self.n_embed_per_ngram

    @classmethod
    def from_dict(cls, block: dict[str, Any], layer_ids: list[int] | None = None) -> EngramConfig:
        ids = layer_ids if layer_ids is not None else block.get("layer_ids", [1, 15])
        n = int(block.get("max_ngram_size", 3))
        return cls(
            layer_ids=tuple(int(i) for i in ids),
            max_ngram_size=n,
            n_embed_per_ngram=int(block.get("n_embed_per_ngram", 512)),
            n_head_per_ngram=int(block.get("n_head_per_ngram", 8)),
            engram_vocab_size=tuple(
                int(v) for v in block.get("engram_vocab_size", [DEFAULT_VOCAB] * (n - 1))
            ),
            kernel_size=int(block.get("kernel_size", 4)),
            pad_id=int(block.get("pad_id", 2)),
            seed=int(block.get("seed", 0)),
            tables_path=block.get("tables_path"),
        )


@dataclass(frozen=True)
class EngramOptions:
    """How a worker serves Engram (from `conduit serve`'s --engram-* flags)."""

    placement: str = "host"  # device | host | split
    shards: int = 2  # host: EngramShardActor processes
    prefetch: bool = True
    lookup_delay_s: float = 0.0  # injected per-lookup latency (benchmarks of the prefetch)
    # host: the step's device reads rows from the shared-memory table in place (CUDA graphs on) or asks
    # the shards over the mailbox; None: in place on CUDA, the mailbox on the CPU
    mapped: bool | None = None


def engram_config_of(config: Any) -> EngramConfig | None:
    """The Engram config of a transformers config object or a config.json dict, or None."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    block, ids = get("engram", None), get("engram_layer_ids", None)
    if block is None and not ids:
        return None
    return EngramConfig.from_dict(dict(block or {}), list(ids) if ids else None)

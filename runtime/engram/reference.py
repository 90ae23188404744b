"""Engram as published (arXiv 2601.07372, the `deepseek-ai/Engram` demo), in plain PyTorch over padded
[B, T] batches: the truth the serving implementation (`hashing.py`, `layer.py`, the placements) is tested
against. Written from the algorithm's description, not for speed: one `nn.Embedding` over a layer's
tables with per-head offsets, `nn.Conv1d` for the short convolution, `sympy.isprime` for the sizes."""

from __future__ import annotations

import math

import numpy as np
import torch
from sympy import isprime
from torch import nn

from runtime.engram.config import EngramConfig


class ReferenceHash:
    """Token ids [B, T] -> per layer, table indices [B, T, (N - 1) * heads] (each within its table)."""

    def __init__(self, cfg: EngramConfig, lookup: np.ndarray) -> None:
        self.cfg = cfg
        self.lookup = np.asarray(lookup, dtype=np.int64)
        vocab = len(set(self.lookup.tolist()))
        self.pad = int(self.lookup[cfg.pad_id])
        bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
        self.multipliers = {}
        for layer in cfg.layer_ids:
            rng = np.random.default_rng(int(cfg.seed + 10007 * layer))
            self.multipliers[layer] = (
                rng.integers(low=0, high=bound, size=(cfg.max_ngram_size,), dtype=np.int64) * 2 + 1
            )
        seen: set[int] = set()
        self.primes: dict[int, list[list[int]]] = {}
        for layer in cfg.layer_ids:
            per_order = []
            for n in range(2, cfg.max_ngram_size + 1):
                start, found = cfg.engram_vocab_size[n - 2] - 1, []
                for _ in range(cfg.n_head_per_ngram):
                    c = start + 1
                    while not (isprime(c) and c not in seen):
                        c += 1
                    seen.add(c)
                    found.append(c)
                    start = c
                per_order.append(found)
            self.primes[layer] = per_order

    def __call__(self, input_ids: np.ndarray) -> dict[int, np.ndarray]:
        x = self.lookup[np.asarray(input_ids, dtype=np.int64)]
        _, t = x.shape
        shifts = [x if k == 0 else np.pad(x, ((0, 0), (k, 0)), constant_values=self.pad)[:, :t]
                  for k in range(self.cfg.max_ngram_size)]  # fmt: skip
        out = {}
        for layer in self.cfg.layer_ids:
            m = self.multipliers[layer]
            heads = []
            for n in range(2, self.cfg.max_ngram_size + 1):
                mix = shifts[0] * m[0]
                for k in range(1, n):
                    mix = np.bitwise_xor(mix, shifts[k] * m[k])
                heads.extend(mix % p for p in self.primes[layer][n - 2])
            out[layer] = np.stack(heads, axis=2)
        return out


class ReferenceShortConv(nn.Module):
    """Per-stream RMSNorm, a depthwise causal Conv1d over all streams' channels, SiLU."""

    def __init__(self, hidden: int, kernel: int, dilation: int, hc_mult: int) -> None:
        super().__init__()
        c = hidden * hc_mult
        self.conv = nn.Conv1d(c, c, kernel, groups=c, bias=False, padding=(kernel - 1) * dilation,
                              dilation=dilation)  # fmt: skip
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-5) for _ in range(hc_mult))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, G, D]
        b, t, g, d = x.shape
        normed = torch.cat([self.norms[i](x[:, :, i]) for i in range(g)], dim=-1)
        y = self.conv(normed.transpose(1, 2))[..., :t]
        return nn.functional.silu(y).transpose(1, 2).reshape(b, t, g, d)


class ReferenceEngram(nn.Module):
    """One layer's Engram: h [B, T, hc_mult, D] and token ids [B, T] -> the output added to h."""

    def __init__(
        self, cfg: EngramConfig, hasher: ReferenceHash, layer_id: int, hidden: int, hc_mult: int
    ) -> None:
        super().__init__()
        self.cfg, self.hasher, self.layer_id, self.hidden, self.hc_mult = (
            cfg,
            hasher,
            layer_id,
            hidden,
            hc_mult,
        )
        sizes = [p for order in hasher.primes[layer_id] for p in order]
        self.register_buffer("offsets", torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()], dtype=torch.long))
        self.embedding = nn.Embedding(sum(sizes), cfg.head_dim)
        self.short_conv = ReferenceShortConv(hidden, cfg.kernel_size, cfg.max_ngram_size, hc_mult)
        e = cfg.hidden
        self.value_proj = nn.Linear(e, hidden)
        self.key_projs = nn.ModuleList(nn.Linear(e, hidden) for _ in range(hc_mult))
        self.norm1 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(hc_mult))
        self.norm2 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(hc_mult))

    def forward(self, h: torch.Tensor, input_ids: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(self.hasher(input_ids)[self.layer_id])
        e = self.embedding(idx + self.offsets).flatten(-2)  # [B, T, (N-1) * n_embed]
        gates = []
        for i in range(self.hc_mult):
            k = self.norm1[i](self.key_projs[i](e))
            q = self.norm2[i](h[:, :, i])
            g = (k * q).sum(-1) / math.sqrt(self.hidden)
            g = g.sign() * g.abs().clamp_min(1e-6).sqrt()
            gates.append(torch.sigmoid(g)[..., None])
        v = torch.stack(gates, dim=2) * self.value_proj(e)[:, :, None]
        return v + self.short_conv(v)

"""The serving Engram layer: one layer's gating, value projection and short convolution over a step's
flattened tokens, reading the rows its placement fetched (`ForwardBatch.engram`).

Its parameter names are the reference's (`key_projs.i`, `value_proj`, `norm1.i`, `norm2.i`,
`short_conv.norms.i`, `short_conv.conv.weight`); the tables are not parameters here (they live in the
placement). The short convolution looks back (kernel - 1) * dilation tokens of each request, which a
decode step does not have: every token's normalised convolution input is kept in a per-token-slot cache
(like KV, so it follows the request's pages and the radix cache), and a token reads the inputs at
positions p - dilation * k through its row of `req_to_token`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.engram.config import EngramConfig

if TYPE_CHECKING:
    from runtime.gpu.forward_batch import ForwardBatch


class ShortConv(nn.Module):
    def __init__(self, hidden: int, kernel: int, hc_mult: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-5) for _ in range(hc_mult))
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(hidden * hc_mult, 1, kernel))


class EngramLayer(nn.Module):
    weights_optional = True  # generated from the seed when the checkpoint has none (init_from_seed)

    def __init__(self, cfg: EngramConfig, layer_id: int, hidden: int, hc_mult: int = 1) -> None:
        super().__init__()
        self.cfg, self.layer_id, self.hidden, self.hc_mult = cfg, layer_id, hidden, hc_mult
        e = cfg.hidden
        self.value_proj = nn.Linear(e, hidden)
        self.key_projs = nn.ModuleList(nn.Linear(e, hidden) for _ in range(hc_mult))
        self.norm1 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(hc_mult))
        self.norm2 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(hc_mult))
        self.short_conv = ShortConv(hidden, cfg.kernel_size, hc_mult)
        self.conv_cache: torch.Tensor | None = None  # [kv slots, hc_mult * hidden]

    @torch.no_grad()
    def init_from_seed(self, std: float = 0.02) -> None:
        """Deterministic weights from the Engram seed and the layer (the same on every device)."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.layer_id)
        for name, p in sorted(self.named_parameters()):
            if ".norm" in f".{name}":
                val = torch.ones(p.shape)
            elif name.endswith("bias"):
                val = torch.zeros(p.shape)
            else:
                val = torch.randn(p.shape, generator=g) * (0.5 if "conv" in name else std)
            p.copy_(val.to(p.dtype))

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The Engram output for hidden states h ([T, D] or [T, hc_mult, D]), to be added to h."""
        t = h.shape[0]
        x = h.view(t, self.hc_mult, self.hidden)
        e = batch.engram.rows(self.layer_id).to(h.dtype)  # [T, (N - 1) * n_embed]
        scale = 1.0 / math.sqrt(self.hidden)
        # the streams' norms and gates in one go: a decode step's Engram layer is small kernels, whose
        # count is what it costs, in a CUDA graph too
        k = _stream_norm(torch.stack([p(e) for p in self.key_projs], dim=1), self.norm1)
        g = (k * _stream_norm(x, self.norm2)).sum(-1) * scale  # [T, hc]
        gates = torch.sigmoid(g.sign() * g.abs().clamp_min(1e-6).sqrt())
        v = gates[..., None] * self.value_proj(e)[:, None]  # [T, hc, D]
        return (v + self._short_conv(v, batch)).view_as(h)

    def _short_conv(self, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = v.shape[0]
        conv = self.short_conv
        normed = _stream_norm(v, conv.norms).view(t, -1)  # [T, C]
        cache = self._cache(batch, normed)
        if any(batch.replay_lens):  # replayed tokens' slots belong to a cached prefix: leave them
            keep = torch.ones(t, dtype=torch.bool)
            starts = torch.cumsum(torch.tensor([0, *batch.extend_lens[:-1]]), 0).tolist()
            for s, r in zip(starts, batch.replay_lens, strict=True):
                keep[s : s + r] = False
            keep = keep.to(normed.device)
            cache[batch.out_loc[keep]] = normed[keep]
        else:
            cache[batch.out_loc] = normed
        if batch.extend_lens:
            rows = torch.repeat_interleave(
                batch.rows, torch.tensor(batch.extend_lens, device=batch.rows.device), output_size=t
            )
        else:  # a decode graph's step (no host lists): one token per row
            rows = batch.rows
        w = conv.conv.weight[:, 0]  # [C, K]
        kernel, dil = w.shape[1], self.cfg.max_ngram_size
        y = w[:, -1] * normed  # the last tap reads the token itself
        if kernel > 1:  # tap k < K - 1 reads position p - (K - 1 - k) * dilation: all taps at once
            back = torch.arange(kernel - 1, 0, -1, device=normed.device) * dil  # [K - 1]
            pos = batch.positions[:, None] - back  # [T, K - 1]
            slots = batch.req_to_token[rows[:, None], pos.clamp(min=0)]
            past = torch.where((pos >= 0)[..., None], cache[slots], 0.0)  # [T, K - 1, C]
            y = y + (past * w[:, :-1].t()).sum(1)
        return nn.functional.silu(y).view(t, self.hc_mult, self.hidden)

    def _cache(self, batch: ForwardBatch, like: torch.Tensor) -> torch.Tensor:
        n = batch.kv_pool.num_slots
        c = self.conv_cache
        if c is None or c.shape[0] != n or c.dtype != like.dtype or c.device != like.device:
            self.conv_cache = c = torch.zeros(n, like.shape[1], dtype=like.dtype, device=like.device)
        return c


def _stream_norm(x: torch.Tensor, norms: nn.ModuleList) -> torch.Tensor:
    """x [T, streams, D] through stream i's RMSNorm for each i, in one op (float32: the per-stream
    modules' values exactly; bf16: within a rounding of them, the weight applied after the normalised
    value is rounded). eps None: the dtype's epsilon, as nn.RMSNorm takes it."""
    eps = norms[0].eps
    weight = torch.stack([n.weight for n in norms])  # [streams, D]
    return nn.functional.rms_norm(x, (x.shape[-1],), eps=eps) * weight


def engram_layer(config, layer_id: int, hidden: int, hc_mult: int = 1) -> EngramLayer | None:  # noqa: ANN001
    """The Engram add-on of decoder layer `layer_id` of a model config, or None (no Engram there)."""
    from runtime.engram.config import engram_config_of

    cfg = engram_config_of(config)
    if cfg is None or layer_id not in cfg.layer_ids:
        return None
    return EngramLayer(cfg, layer_id, hidden, hc_mult)


def slot_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes per KV slot of the Engram layers' convolution caches in `model` (0 without Engram)."""
    return sum(m.hc_mult * m.hidden * dtype.itemsize for m in model.modules() if isinstance(m, EngramLayer))

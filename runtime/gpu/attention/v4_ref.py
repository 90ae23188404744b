"""DeepSeek-V4 attention in plain PyTorch over the per-request state (`kv_cache_v4.V4StateCache`).

Per request and layer, each query t attends one shared K=V head over
- the sliding window: keys at positions (t - window, t], from the ring plus this step's rows;
- CSA / HCA layers: the compressed entries w < (t + 1) // rate (emitted so far, including the windows
  this step closes), and for CSA only the Lightning Indexer's top-k of those;
plus a per-head sink logit that takes probability mass but has no value. Requests are attended one by
one (a reference, not a kernel); prefill, chunked prefill and decode are the same code path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kv_cache_v4 import CompressorState

if TYPE_CHECKING:
    from runtime.gpu.layers.compressor import Compressor
    from runtime.gpu.layers.interleaved_rope import InterleavedRope
    from runtime.gpu.models.deepseek_v4 import DeepseekV4Attention


def attend_with_sink(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
):
    """q [L, H, d], kv [K, d] (keys = values), mask [L, K] bool, sinks [H] -> [L, H, d]."""
    logits = torch.einsum("lhd,kd->hlk", q, kv) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hlk,kd->lhd", probs.to(kv.dtype), kv)


@dataclass
class _Row:
    row: int
    start: int
    length: int
    prefix: int
    positions: torch.Tensor  # [length] on the device


def compress_step(
    comp: Compressor, state: CompressorState, x: torch.Tensor, prefix: int, rope: InterleavedRope
) -> torch.Tensor:
    """Feed one request's new tokens x [L, D] (positions prefix..) to a compressor: emit the entries of
    the windows they close into `state`, keep the tail; return all entries so far [N, dim]."""
    m, span, length = comp.rate, comp.tail_len, x.shape[0]
    kv, gate = comp.project(x)
    w0, w1 = prefix // m, (prefix + length) // m
    if w1 > w0:
        back = 1 if comp.overlap and w0 > 0 else 0  # the closed window whose Ca half entry w0 needs
        old = torch.arange((w0 - back) * m, prefix, device=x.device) % span
        new = w1 * m - prefix
        raw_kv = torch.cat([state.tail_kv.index_select(0, old), kv[:new]])
        raw_gate = torch.cat([state.tail_gate.index_select(0, old), gate[:new]])
        state.entries[w0:w1] = comp.pool(raw_kv, raw_gate, w0 - back, rope)[back:]
    keep = min(length, span)
    slots = torch.arange(prefix + length - keep, prefix + length, device=x.device) % span
    state.tail_kv[slots] = kv[length - keep :]
    state.tail_gate[slots] = gate[length - keep :]
    return state.entries[:w1]


class TorchV4Backend(AttentionBackend):
    supports_cuda_graph = False

    def __init__(self, num_heads: int, head_dim: int, sliding_window: int) -> None:
        super().__init__(num_heads, 1, head_dim, head_dim**-0.5)
        self.window = sliding_window

    def prepare(self, batch: ForwardBatch) -> None:
        rows, start = [], 0
        for row, prefix, length in zip(batch.rows_list, batch.prefix_lens, batch.extend_lens, strict=True):
            if length:
                if prefix == 0:
                    batch.kv_cache.reset(row)
                rows.append(_Row(row, start, length, prefix, batch.positions[start : start + length]))
            start += length
        batch.attn_meta = rows

    def forward(self, layer, q, k, v, batch):  # noqa: ANN001 - the MHA entry point
        raise NotImplementedError("V4 layers call forward_v4")

    def forward_v4(
        self,
        attn: DeepseekV4Attention,
        q: torch.Tensor,
        kv: torch.Tensor,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, H, d], kv [T, d] (roped) of the step's tokens; x [T, D] the layer input and qr [T, q_lora]
        the normed q latent (for the compressors and the indexer). Returns [T, H, d]."""
        out = torch.empty_like(q)
        w = self.window
        for r in batch.attn_meta:
            s, e, p, pos = r.start, r.start + r.length, r.prefix, r.positions
            state = batch.kv_cache.layer(r.row, attn.layer_id)
            lo = max(0, p - w + 1)
            key_pos = torch.arange(lo, p + r.length, device=q.device)
            keys = torch.cat([state.window.index_select(0, key_pos[: p - lo] % w), kv[s:e]])
            mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - w)
            comp = attn.compressor
            if comp is not None:
                entries = compress_step(comp, state.compressor, x[s:e], p, attn.rope)
                visible = (
                    torch.arange(entries.shape[0], device=q.device)[None, :]
                    < ((pos + 1) // comp.rate)[:, None]
                )
                if comp.indexer is not None:
                    index_keys = compress_step(comp.indexer, state.indexer, x[s:e], p, attn.rope)
                    visible = visible & comp.indexer.select(x[s:e], qr[s:e], pos, index_keys, attn.rope)
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, visible], dim=1)
            out[s:e] = attend_with_sink(q[s:e], keys, mask, attn.sinks, self.scale)
            keep = min(r.length, w)
            state.window[key_pos[-keep:] % w] = kv[e - keep : e]
        return out

"""Reference attention in plain PyTorch (SDPA) over the paged cache: the truth for every kernel.

Decode rows (one new token each) are attended together in one padded, masked SDPA call per layer;
prefill rows are attended one by one, each with its causal mask offset by the cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.gpu.attention.base import MHABackend, Rope
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.rope import ROPE


@dataclass
class _Prefill:
    start: int  # first token of the row in the flattened batch
    length: int
    prefix: int
    slots: torch.Tensor | None  # KV slots of prefix + new tokens; None when there is no prefix
    mask: torch.Tensor | None  # [length, prefix + length] causal mask shifted by the prefix


@dataclass
class _Meta:
    decode_tokens: torch.Tensor | None  # [B] token index of each decode row; None if no decode rows
    decode_all: bool  # every token of the batch is a decode token, in order: skip the gather/scatter
    decode_slots: torch.Tensor | None  # [B * S] KV slots, padded, flattened for index_select
    decode_shape: tuple[int, int] | None
    decode_mask: torch.Tensor | None  # [B, 1, q_len, S]
    prefills: list[_Prefill]
    q_len: int = 1  # decode rows' query tokens (verify steps under graphs: draft tokens + 1)


class TorchAttentionBackend(MHABackend):
    def _split_rows(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int], list[_Prefill]]:
        """Host lists of the step's decode rows (token index, row, length with the new token) and its
        prefill/extend rows (one `_Prefill` each), in plan order."""
        dec_tok, dec_rows, dec_lens, prefills = [], [], [], []
        start = 0
        for row, prefix, length in zip(batch.rows_list, batch.prefix_lens, batch.extend_lens, strict=True):
            if length == 1:
                dec_tok.append(start)
                dec_rows.append(row)
                dec_lens.append(prefix + 1)
            elif length > 1:
                prefills.append(self._prefill(batch, row, start, length, prefix))
            start += length
        return dec_tok, dec_rows, dec_lens, prefills

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        dec_tok, dec_rows, dec_lens, prefills = self._split_rows(batch)
        meta = _Meta(None, False, None, None, None, prefills)
        if dec_tok:
            host = torch.tensor([dec_tok, dec_rows, dec_lens], dtype=torch.int64)
            tok, rows, lens = host.to(device, non_blocking=True).unbind(0)
            max_len = max(dec_lens)
            meta.decode_tokens = tok
            meta.decode_all = len(dec_tok) == batch.num_tokens
            meta.decode_slots = batch.req_to_token[rows, :max_len].reshape(-1)
            meta.decode_shape = (len(dec_tok), max_len)
            if min(dec_lens) < max_len:  # unequal lengths: mask the padding (unmasked SDPA is faster)
                valid = torch.arange(max_len, device=device)[None, :] < lens[:, None]
                meta.decode_mask = valid[:, None, None, :]
        batch.attn_meta = meta

    supports_cuda_graph = True
    supports_verify_graph = True

    def prepare_decode_graph(
        self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int, q_len: int = 1
    ) -> None:
        """All rows padded to `max_seq_len` keys and masked: slow for long contexts, but graph-safe."""
        b = batch.rows.shape[0]
        cols = torch.arange(max_seq_len, device=seq_lens.device)
        meta = _Meta(cols[: b * q_len], True, None, (b, max_seq_len), None, [], q_len)
        meta.decode_slots = batch.req_to_token[batch.rows, :max_seq_len].reshape(-1)
        # query i of a row sees the keys before seq_len - q_len + 1 + i
        limit = seq_lens[:, None] - q_len + 1 + torch.arange(q_len, device=seq_lens.device)[None, :]
        meta.decode_mask = (cols[None, None, :] < limit[:, :, None])[:, None, :, :]
        batch.attn_meta = meta

    @staticmethod
    def _prefill(batch: ForwardBatch, row: int, start: int, length: int, prefix: int) -> _Prefill:
        if prefix == 0:
            return _Prefill(start, length, 0, None, None)
        device = batch.input_ids.device
        total = prefix + length
        q_pos = prefix + torch.arange(length, device=device)
        mask = torch.arange(total, device=device)[None, :] <= q_pos[:, None]
        return _Prefill(start, length, prefix, batch.req_to_token[row, :total], mask)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        cache, meta = batch.kv_pool, batch.attn_meta
        if rope is not None:  # unfused: a fresh prompt below attends this step's rotated k directly
            q, k, v = rope.prescale(q, k, v)
            q, k = ROPE.get(q.device)(rope.positions, q, k, rope.cos, rope.sin)
        cache.store(layer, batch.out_loc, k, v)
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        out = torch.empty_like(q)
        if meta.decode_tokens is not None:
            qd = q if meta.decode_all else q[meta.decode_tokens]
            rows, ql = meta.decode_shape[0], meta.q_len
            qd = qd.view(rows, ql, *qd.shape[1:]).transpose(1, 2)  # [B, Hq, q_len, D]
            # index_select: several times faster than advanced indexing for row gathers on CPU
            shape = (*meta.decode_shape, *k_pool.shape[1:])
            kd = (
                k_pool.index_select(0, meta.decode_slots).view(shape).transpose(1, 2).to(q.dtype)
            )  # [B, Hkv, S, D]
            vd = v_pool.index_select(0, meta.decode_slots).view(shape).transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(rows * ql, q.shape[1], q.shape[2])
            if meta.decode_all:
                return o
            out[meta.decode_tokens] = o
        for p in meta.prefills:
            end = p.start + p.length
            qp = q[p.start : end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
            if p.slots is None:  # fresh prompt: its keys are exactly this step's keys
                kp, vp = k[p.start : end], v[p.start : end]
            else:
                kp, vp = (
                    k_pool.index_select(0, p.slots).to(q.dtype),
                    v_pool.index_select(0, p.slots).to(q.dtype),
                )
            o = F.scaled_dot_product_attention(
                qp,
                kp.transpose(0, 1).unsqueeze(0),
                vp.transpose(0, 1).unsqueeze(0),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[p.start : end] = o[0].transpose(0, 1)
        return out

"""Multi-head latent attention (MLA, DeepSeek V2/V3) in plain PyTorch over the paged latent cache.

Each token caches one row `[c (kv_lora_rank) | k_pe (qk_rope_head_dim)]` (`LatentKVPool`, kv_pool.py). Per head h,
keys are `[W_UK[h] c | k_pe]` and values `W_UV[h] c`, with W_UK/W_UV the two halves of `kv_b_proj`.

- Prefill rows: expanded form. The latents of the step's prefill rows are expanded to per-head K and V
  and attended like ordinary multi-head attention (compute-bound, few keys per query), all rows in one
  call of the `mla_prefill` op (Triton on CUDA, the PyTorch reference elsewhere; both backends).
- Decode rows: absorbed form. `q_nope W_UK[h]` maps each query into the latent space, so every head
  attends the same single-"head" latent rows (MQA, d_qk = r + d_rope, d_v = r), and `W_UV` is applied
  to the attention output: the cache is read once per step, never expanded.

Both give the same result (`tests/unit/gpu/test_deepseek_v3_layers.py`). Step metadata is the
reference backend's (`TorchAttentionBackend.prepare`), with the prefill rows grouped for `mla_prefill`."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from runtime.gpu.attention.torch_ref import TorchAttentionBackend, _Prefill
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.mla_prefill import MLA_PREFILL

# Expanded K + V elements per `mla_prefill` call (2 GiB in bf16): bounds the transient memory of a step
# whose prefill rows have long cached prefixes (DeepSeek-V3, 128 heads: ~26K latent rows per call).
EXPANDED_ELEMENTS = 1 << 30


def mla_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q_nope [L, H, dn], q_pe [L, H, dr]; latent [S, r + dr]; w_uk [H, dn, r], w_uv [H, dv, r].
    mask: [L, S] bool (True = attend) or None; `causal` when L == S and there is no mask. -> [L, H, dv]"""
    r = w_uk.shape[-1]
    c, k_pe = latent[:, :r], latent[:, r:]
    k_nope = torch.einsum("sr,hdr->hsd", c, w_uk)
    v = torch.einsum("sr,hvr->hsv", c, w_uv)
    k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(k_nope.shape[0], -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
    )
    return o[0].transpose(0, 1)


def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latents: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    q_len: int = 1,
) -> torch.Tensor:
    """q_len queries per row (consecutive). q_nope [B * q_len, H, dn], q_pe [B * q_len, H, dr]; latents
    [B, S, r + dr]; mask [B, 1, q_len, S] bool (or [B, 1, 1, S]) or None. -> [B * q_len, H, dv]"""
    r, b = w_uk.shape[-1], latents.shape[0]
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe], dim=-1)
    q = q.view(b, q_len, *q.shape[1:]).transpose(1, 2)  # [B, H, q_len, r + dr]
    k = latents.unsqueeze(1)  # [B, 1, S, r + dr]: one latent "head" shared by all query heads
    o = F.scaled_dot_product_attention(q, k, k[..., :r], attn_mask=mask, scale=scale, enable_gqa=True)
    return torch.einsum("bhr,hvr->bhv", o.transpose(1, 2).reshape(b * q_len, -1, r), w_uv)


class PrefillGroup(NamedTuple):
    """Consecutive prefill rows attended by one `mla_prefill` call."""

    rows: list[_Prefill]
    cols: torch.Tensor  # [4, n] int32 on the device: q starts, q lengths, kv starts (in the group's
    # concatenated latents), kv lengths
    max_q_len: int


class TorchMLABackend(TorchAttentionBackend):
    """The reference MLA backend. Models call `forward_mla`; `forward` (separate K and V) does not apply.

    Graph-safe like the reference MHA backend (decode rows padded to `max_seq_len` keys and masked), so
    slow under CUDA graphs for long contexts; `attention_kernel.MLAKernelBackend` is the fast path. The step
    metadata's `prefills` are `PrefillGroup`s here (built once per step in `prepare`)."""

    supports_cuda_graph = True

    def __init__(
        self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float, qk_nope_dim: int, v_dim: int
    ) -> None:
        super().__init__(num_heads, 1, kv_lora_rank + rope_dim, scale)
        self.kv_lora_rank = kv_lora_rank
        # expanded K + V elements per latent row: what a prefill group's transient memory scales with
        self.expanded_per_key = num_heads * (qk_nope_dim + rope_dim + v_dim)

    def prepare(self, batch: ForwardBatch) -> None:
        super().prepare(batch)
        meta = batch.attn_meta
        meta.prefills = self.group_prefills(meta.prefills, batch.input_ids.device)

    @staticmethod
    def _prefill(batch: ForwardBatch, row: int, start: int, length: int, prefix: int) -> _Prefill:
        """The row's slots but no prefix-shifted mask: `mla_prefill` applies the causal rule itself."""
        slots = batch.req_to_token[row, : prefix + length] if prefix else None
        return _Prefill(start, length, prefix, slots, None)

    def forward(self, layer, q, k, v, batch):  # noqa: ANN001 - the MHA entry point
        raise NotImplementedError("MLA layers call forward_mla")

    def forward_mla(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr]; latent [T, 1, r + dr] of the new tokens (stored here);
        w_uk [H, dn, r], w_uv [H, dv, r]. Returns [T, H, dv]."""
        cache, meta = batch.kv_pool, batch.attn_meta
        cache.store(layer, batch.out_loc, latent)
        pool = cache.kv[layer]  # [slots, 1, r + dr]
        out = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])
        if self._has_decode_rows(meta):
            qn = q_nope if meta.decode_all else q_nope[meta.decode_tokens]
            qp = q_pe if meta.decode_all else q_pe[meta.decode_tokens]
            o = self._decode(qn, qp, pool, w_uk, w_uv, batch)
            if meta.decode_all:
                return o
            out[meta.decode_tokens] = o
        self.forward_prefills(meta.prefills, q_nope, q_pe, latent, pool[:, 0], w_uk, w_uv, out)
        return out

    @staticmethod
    def _has_decode_rows(meta) -> bool:  # noqa: ANN001 - the backend's step metadata
        return meta.decode_tokens is not None

    def _decode(self, q_nope, q_pe, pool, w_uk, w_uv, batch: ForwardBatch) -> torch.Tensor:  # noqa: ANN001
        """The decode rows' [B, H, dv] in the absorbed form; pool [slots, 1, r + dr]."""
        meta, rows = batch.attn_meta, pool[:, 0]
        lat = rows.index_select(0, meta.decode_slots).view(*meta.decode_shape, rows.shape[-1])
        lat = lat.to(q_nope.dtype)  # an e4m3 pool (--kv-cache-dtype fp8_e4m3) is read upcast
        return mla_absorbed(q_nope, q_pe, lat, w_uk, w_uv, self.scale, meta.decode_mask, meta.q_len)

    def forward_prefills(self, groups, q_nope, q_pe, latent, pool, w_uk, w_uv, out) -> None:  # noqa: ANN001
        """The rows with several new tokens, in the expanded form, into `out` (shared with the kernel
        backend): per group, the rows' latents (this step's for a fresh prompt, prefix + new slots of the
        pool otherwise) concatenated and expanded to per-head K and V with one matmul per weight, then one
        call of the `mla_prefill` op (causal, each row's queries the last of its keys)."""
        if not groups:
            return
        r, heads = w_uk.shape[-1], w_uk.shape[0]
        q = torch.cat([q_nope, q_pe], dim=-1)  # decode tokens too (few): no gather, and `out` is shared
        attend = MLA_PREFILL.get(q.device)
        for rows, cols, max_q_len in groups:
            lats = [latent[p.start : p.start + p.length, 0] if p.slots is None
                    else pool.index_select(0, p.slots).to(latent.dtype) for p in rows]  # fmt: skip
            lat = lats[0] if len(lats) == 1 else torch.cat(lats)
            c, k_pe = lat[:, :r], lat[:, r:]
            k_nope = torch.einsum("sr,hdr->shd", c, w_uk)  # [S, H, dn]
            v = torch.einsum("sr,hvr->shv", c, w_uv)  # [S, H, dv]
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
            attend(q, k, v, *cols, self.scale, max_q_len=max_q_len, out=out)

    def group_prefills(self, prefills: list[_Prefill], device: torch.device) -> list[PrefillGroup]:
        """Consecutive rows whose expanded K/V fit EXPANDED_ELEMENTS (a longer row alone), with their
        columns moved to `device` in one copy per group."""
        groups, cur, keys = [], [], 0
        for p in prefills:
            n = p.prefix + p.length
            if cur and (keys + n) * self.expanded_per_key > EXPANDED_ELEMENTS:
                groups.append(cur)
                cur, keys = [], 0
            cur.append(p)
            keys += n
        if cur:
            groups.append(cur)
        out = []
        for rows in groups:
            kv_lens = [p.prefix + p.length for p in rows]
            kv_starts = [0, *itertools.accumulate(kv_lens)][:-1]
            host = [[p.start for p in rows], [p.length for p in rows], kv_starts, kv_lens]
            cols = torch.tensor(host, dtype=torch.int32).to(device, non_blocking=True)
            out.append(PrefillGroup(rows, cols, max(p.length for p in rows)))
        return out

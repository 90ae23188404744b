"""MLA through the kernel ops: decode rows run the registry's `mla_decode` (FlashMLA or Triton on CUDA,
the reference elsewhere) in the absorbed form; prefill rows the expanded form of the reference backend.

Per decode row: q_lat = q_nope W_UK (per head, into the latent space), the kernel attends [q_lat | q_pe]
over the row's latent slots (keys are whole rows, values their first kv_lora_rank dims), and W_UV maps
the result back to v_head_dim. The kernel reads the slots through req_to_token and each row's length
on the device, so under CUDA graphs the only host-side choice, the split count, is fixed per bucket
(from the batch size and req_to_token's width); eager steps choose it from their longest row. With a
pool paged in multiples of 64 tokens, the step hands the kernel a 64-token page table instead (derived
on the device once per step): the TileLang kernel then loads whole tiles by TMA (docs/kernels.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.common import choose_num_splits
from runtime.gpu.kernels.mla_decode import MLA_DECODE
from runtime.gpu.kernels.mla_decode.reference import page_table
from runtime.gpu.models.deepseek_v3.attention_ref import PrefillGroup, TorchMLABackend

log = structlog.get_logger(__name__)

HEAD_BLOCK = 16  # q heads per program of the Triton kernel: eager steps choose splits per head block
TABLE_PAGE = 64  # the kernels' KV tile: a pool paged in multiples of it is read through a page table


@dataclass
class _Meta:
    decode_tokens: torch.Tensor | None  # [B] token index of each decode row (None: no decode rows)
    decode_all: bool  # every token is a decode token, in row order: no gather/scatter
    rows: torch.Tensor | None  # [B] req_to_token rows of the decode rows
    seq_lens: torch.Tensor | None  # [B] their lengths including the new token
    num_splits: int | None = None  # None: the kernel picks it from the table width (host-side, fixed)
    prefills: list[PrefillGroup] = field(default_factory=list)
    table: torch.Tensor | None = None  # what the decode kernel reads: req_to_token or its page table
    table_page: int = 1
    q_len: int = 1  # query tokens per decode row (verify steps under graphs: draft tokens + 1)


class MLAKernelBackend(TorchMLABackend):
    supports_cuda_graph = True
    decode_fn: Callable[..., torch.Tensor] | None = None  # bound from the registry on first use

    def _splits(self, batch: int, max_len: int, device: torch.device) -> int:
        head_blocks = -(-self.num_heads // HEAD_BLOCK)
        return choose_num_splits(batch, head_blocks, max_len, device)

    def _bind(self, device: torch.device, pool_dtype: torch.dtype) -> None:
        if self.decode_fn is None:
            impl = MLA_DECODE.select(device)
            e4m3 = pool_dtype == torch.float8_e4m3fn
            if impl.name == "flash_mla" and (self.page_size % TABLE_PAGE or e4m3):
                # FlashMLA's dense decode reads 16-bit 64-token pages: other pools take the next
                # implementation (ours upcast an e4m3 pool as they load it)
                impl = next(
                    i for i in MLA_DECODE.implementations() if i.name != impl.name and i.available(device)
                )
                log.info(
                    "mla_decode: FlashMLA needs 16-bit pages of 64",
                    page_size=self.page_size, pool_dtype=str(pool_dtype), using=impl.name,
                )  # fmt: skip
            if e4m3 and device.type == "cuda":
                log.warning(
                    "mla_decode: an e4m3 latent pool is read by the Triton kernel, which upcasts it: decode"
                    " attention 2-8x slower than the 16-bit TileLang kernel's (docs/PERF.md), for half the pool"
                )
            self.decode_fn = impl.load()

    def _decode_table(self, meta: _Meta, req_to_token: torch.Tensor) -> None:
        """Whole 64-token tiles sit in consecutive slots when the pool's pages hold whole tiles."""
        meta.table_page = TABLE_PAGE if self.page_size % TABLE_PAGE == 0 else 1
        meta.table = page_table(req_to_token, TABLE_PAGE) if meta.table_page > 1 else req_to_token

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        self._bind(device, batch.kv_pool.kv[0].dtype)
        dec_tok, dec_rows, dec_lens, prefills = self._split_rows(batch)
        meta = _Meta(None, False, None, None, None, self.group_prefills(prefills, device))
        if dec_tok:
            host = torch.tensor([dec_tok, dec_rows, dec_lens], dtype=torch.int64)
            meta.decode_tokens, meta.rows, meta.seq_lens = host.to(device, non_blocking=True).unbind(0)
            meta.decode_all = len(dec_tok) == batch.num_tokens
            meta.num_splits = self._splits(len(dec_tok), max(dec_lens), device)
            self._decode_table(meta, batch.req_to_token)
        batch.attn_meta = meta

    def prepare_decode_graph(
        self, batch: ForwardBatch, seq_lens: torch.Tensor, max_seq_len: int, q_len: int = 1
    ) -> None:
        """The split count is left to the kernel: each implementation derives it on the host from the
        batch, its own head block and req_to_token's width (max_model_len), so it is fixed per bucket.
        Verify steps: q_len tokens per row, the kernel's causal multi-query form."""
        self._bind(batch.input_ids.device, batch.kv_pool.kv[0].dtype)
        batch.attn_meta = _Meta(None, True, batch.rows, seq_lens, None, q_len=q_len)
        self._decode_table(batch.attn_meta, batch.req_to_token)  # captured: replays re-derive it

    @staticmethod
    def _has_decode_rows(meta: _Meta) -> bool:
        return meta.rows is not None  # graph steps leave decode_tokens None (every token decodes)

    def _decode(self, q_nope, q_pe, pool, w_uk, w_uv, batch: ForwardBatch) -> torch.Tensor:  # noqa: ANN001
        """The `mla_decode` op on [q_nope W_UK | q_pe] over the latent pool, then W_UV."""
        meta = batch.attn_meta
        q = absorbed_query(q_nope, q_pe, w_uk)
        o = self.decode_fn(
            q, pool, meta.table, meta.rows, meta.seq_lens, self.scale,
            kv_lora_rank=self.kv_lora_rank, num_splits=meta.num_splits, page_size=meta.table_page,
            q_len=meta.q_len,
        )  # fmt: skip
        return torch.einsum("bhr,hvr->bhv", o, w_uv)


def absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[q_nope W_UK | q_pe]: q_nope [T, H, dn], q_pe [T, H, dr], w_uk [H, dn, r] -> [T, H, r + dr]. The
    per-head matmul writes straight into the first r columns (a strided batched GEMM output), and only
    q_pe is copied after it: a verify step has 4x a decode step's rows, and concatenating the two parts
    copied all r + dr columns once more."""
    t, h, _ = q_nope.shape
    r = w_uk.shape[-1]
    q = q_nope.new_empty(t, h, r + q_pe.shape[-1])
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q[..., :r].transpose(0, 1))
    q[..., r:] = q_pe
    return q

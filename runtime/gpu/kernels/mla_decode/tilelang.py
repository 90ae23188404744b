"""MLA decode (absorbed, DeepSeek-V2/V3) in TileLang, the host side: where the kernel runs (`available`,
`supported`; anything else goes to the Triton kernel), how many KV splits fill the GPU, and the launcher.
The kernel and its two schedules (three warpgroup roles with a gather; the seesaw with TMA on pages of
64) are built in `tilelang_kernel.py`."""

import torch

from runtime.gpu.kernels.common import LOG2E, MAX_SPLITS, MIN_SPLIT_TOKENS, num_sms
from runtime.gpu.kernels.mla_decode.reference import pool_2d
from runtime.gpu.kernels.mla_decode.tilelang_kernel import kernel
from runtime.gpu.kernels.mla_decode.tilelang_tiles import BLOCK_H
from runtime.gpu.kernels.registry import is_hopper as _hopper
from runtime.gpu.kernels.registry import tilelang_importable as _importable

_TL_DTYPE = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def available(device: torch.device) -> bool:
    """`registry.tilelang_on_hopper`, spelled with this module's names so that tests can patch them."""
    return device.type == "cuda" and _hopper(device) and _importable()


def supported(q: torch.Tensor, kv_lora_rank: int) -> bool:
    """What the kernel is built for: bf16/fp16, d_v a multiple of 128, rope dims a multiple of 8 up to
    64 (DeepSeek: 512 + 64). Anything else goes to the Triton kernel."""
    d_pe = q.shape[-1] - kv_lora_rank
    return (
        q.dtype in (torch.bfloat16, torch.float16)
        and kv_lora_rank % 128 == 0
        and 0 < d_pe <= 64
        and d_pe % 8 == 0
    )


def choose_num_splits(batch: int, head_blocks: int, max_tokens: int, device: torch.device) -> int:
    """The fewest splits (a power of two) whose grid fills the SMs in whole waves to >= 85%: one CTA
    fits per SM (224 KB of shared memory), so a partial last wave idles SMs, while extra splits cost
    partial writes and a combine. No split under MIN_SPLIT_TOKENS tokens. Host-only."""
    sms = num_sms(device)
    cap = max(1, min(MAX_SPLITS, -(-max_tokens // MIN_SPLIT_TOKENS)))
    base = max(1, batch * head_blocks)
    best, best_eff = 1, 0.0
    s = 1
    while s <= cap:
        ctas = base * s
        eff = ctas / (-(-ctas // sms) * sms)
        if eff >= 0.85:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
        s *= 2
    return best


def mla_decode_paged(
    q, pool, table, rows, seq_lens, scale, kv_lora_rank, page, num_splits=None, out=None, lse=None, q_len=1
):
    """`triton.mla_decode_paged`'s parameters and results (the launcher both entry points share) on this
    kernel; what `supported` does not cover runs the Triton one. q_len > 1: q is [rows * q_len, Hq, D],
    viewed as [rows, q_len * Hq, D] for the kernel's virtual heads (`tilelang_kernel.py`)."""
    tokens, num_heads, dim = q.shape
    d_pe = dim - kv_lora_rank
    if not supported(q, kv_lora_rank) or pool.dtype != q.dtype:
        # e.g. float32 tests, or an e4m3 pool (--kv-cache-dtype fp8_e4m3): the Triton kernel upcasts
        from runtime.gpu.kernels.mla_decode import triton

        return triton.mla_decode_paged(
            q, pool, table, rows, seq_lens, scale, kv_lora_rank, page, num_splits, out, lse, q_len=q_len
        )  # fmt: skip
    assert pool.shape[-1] == dim and pool.dtype == q.dtype, (q.shape, pool.shape, pool.dtype)
    assert pool.is_contiguous(), "the latent pool is indexed densely (a [slots, D] view)"
    batch = rows.shape[0]
    assert tokens == batch * q_len, (q.shape, rows.shape, q_len)
    q, table = q.contiguous(), table.contiguous()  # no-ops for the engine's tensors
    out = q.new_empty(tokens, num_heads, kv_lora_rank) if out is None else out
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.is_contiguous() and lse.is_contiguous()
    if batch == 0:
        return out, lse
    heads = num_heads * q_len  # the kernel's view: a row's q_len tokens side by side in the head dimension
    head_blocks = -(-heads // BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, table.shape[1] * page, q.device)
    split = num_splits > 1
    compiled = kernel(
        num_heads, q_len, kv_lora_rank, d_pe, _TL_DTYPE[q.dtype], _TL_DTYPE[table.dtype],
        _TL_DTYPE[rows.dtype], _TL_DTYPE[seq_lens.dtype], page, split, float(scale * LOG2E),
    )  # fmt: skip
    qv, outv, lsev = q.view(batch, heads, dim), out.view(batch, heads, kv_lora_rank), lse.view(batch, heads)
    if split:
        mid_o = torch.empty(batch, heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
        compiled(qv, pool, table, rows, seq_lens, mid_o, mid_lse, outv, lsev)
    else:
        compiled(qv, pool, table, rows, seq_lens, outv, lsev)
    return out, lse


def mla_decode(
    q, latent_pool, req_to_token, rows, seq_lens, scale, kv_lora_rank=512, num_splits=None, out=None,
    return_lse=False, page_size=1, q_len=1,
):  # fmt: skip
    """`MlaDecode`: with a page table of pages of a multiple of 64 tokens, whole tiles arrive by TMA and
    the seesaw schedule runs (`tilelang_tiles.tiled`). Verify steps (q_len > 1) put a row's q_len
    tokens in the head dimension, each virtual head masked at its own position."""
    o, lse = mla_decode_paged(
        q, pool_2d(latent_pool), req_to_token, rows, seq_lens, scale, kv_lora_rank, page_size, num_splits, out,
        q_len=q_len,
    )  # fmt: skip
    return (o, lse) if return_lse else o

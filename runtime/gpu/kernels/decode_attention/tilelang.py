"""Stage 1 of paged GQA decode over an fp8 (e4m3) KV pool, in TileLang: a producer warpgroup that owns
the K/V pipeline, consumer warps that keep their math in registers.

Why next to `triton.py`: with an fp8 pool the Triton kernel streams 2.5-2.9 TB/s where a copy reaches
4.2 (docs/PERF.md). Its pipeliner gathers a step's K/V rows behind that step's slot loads, and its dot
needs the e4m3 tile converted to float16 in shared memory first. Here:

- The producer (threads 128-255) looks each tile's slots up `ahead` tiles early and gathers the tokens'
  K and V rows (128 B each at head dim 128) with cp.async, 16 bytes a thread, into a ring of `stages`
  64-token buffers. Tokens past the split's end re-read its last token (their scores are -inf), so a
  ragged tail never reads a slot the row does not own. With pages of a multiple of 64 tokens and head
  dim 128, a whole tile is one page: its K and V arrive by two TMA bulk copies ([64 slots x 128 B], 1 KB
  apart in the pool), swizzled by the TMA unit the way the warps read them; only a row's partial last
  tile is gathered.
- Four consumer warps (threads 0-127) each own 16 tokens of every tile (`gqa_fp8_warp.cuh`): they load
  their bytes of K and V into registers (the ring slot is free again right after), convert e4m3 pairs
  straight into mma operands and run S^T = K q^T and O^T += V^T P^T on mma.sync (the warp's 16 tokens,
  then 16 of the head dims, as the rows; the GQA group's q heads, at most 8, as the columns) with an
  online softmax in float32 base 2. They never synchronise inside the loop; they merge their states
  once, at the end.

A work item is a (kv head, row, split). With more items than fit the GPU, two persistent CTAs an SM
walk them, the ring running on from one item to the next; otherwise a CTA per item. Two CTAs fit an SM
(setmaxnreg gives the consumers 160 registers). The output is stage 1's contract in `triton.py` (a
normalised float32 partial and its base-2 log-sum-exp per split), merged by its stage 2; with one split
the kernel writes the attention output itself instead (`triton.split_kv(direct=True)`).
"""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations (T.Tensor
# shapes built from local variables) at decoration time.
import functools
from pathlib import Path

import torch

from runtime.gpu.kernels.common import LOG2E, num_sms
from runtime.gpu.kernels.registry import is_hopper as _hopper
from runtime.gpu.kernels.registry import tilelang_importable as _importable

BLOCK_N = 64  # tokens per tile (and the split granularity stage 2 is told)
MAX_GROUP = 8  # q heads per kv head: the mma tile's 8 columns
STAGES = 5  # ring buffers of fp8 K and V (16 KB a stage at d 128; 4 at d 256)
AHEAD = 2  # the producer looks slots up this many tiles before it copies them
BLOCKS_PER_SM = 2  # CTAs an SM should hold (caps registers at 65536 / (256 x this))
# Persistent CTAs, BLOCKS_PER_SM an SM, walk the work items when there are more items than that: 2-4%
# faster per layer at B=64-256 on the H200 than a CTA per item, which spends its start-up (row, length
# and slot loads) idle. With no more items than CTAs there is nothing to walk: those launches keep a CTA
# per item (docs/PERF.md). Whole 64-token pages arrive by TMA where the pool's pages allow (0-3% a layer
# over the gather on the same pages; +1.5-2.2% on the Llama-8B end-to-end benchmark).

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int32: "int32", torch.int64: "int64"}


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _hopper(device) and _importable()


def supported(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """What the kernel is built for: an e4m3 pool, 16-bit queries whose heads are dense rows (the q slice
    of a fused qkv output qualifies), head dim 64, 128 or 256 and a GQA group of at most 8 q heads per
    kv head."""
    group = q.shape[1] // k_pool.shape[1]
    dim = q.shape[2]
    return (
        k_pool.dtype == torch.float8_e4m3fn
        and q.dtype in (torch.bfloat16, torch.float16)
        and dim in (64, 128, 256)
        and group <= MAX_GROUP
        and q.stride(1) == dim
        and q.stride(2) == 1
    )


@functools.cache
def _kernel(
    num_kv_heads: int,
    group: int,
    head_dim: int,
    q_dtype: str,
    table_dtype: str,
    rows_dtype: str,
    lens_dtype: str,
    sm_scale: float,
    ctas: int = 0,
    direct: bool = False,
    page: int = 1,
):
    """Compile one variant; `sm_scale` is the softmax scale times log2(e). Batch, pool size, table shape
    and split count are dynamic; `ctas` > 0: that many persistent CTAs, 0: a CTA per work item. `direct`
    (one split): the output itself goes to Out in q's dtype, MidO and MidLse are not written. `page`: the
    pool's page size (64: whole tiles by TMA at head dim 128; 1: any layout)."""
    import tilelang
    import tilelang.language as T
    from tilelang.layout import make_full_bank_swizzled_layout

    stages = STAGES if head_dim <= 128 else 4
    ahead = AHEAD
    blocks_per_sm = BLOCKS_PER_SM
    # TMA's 128-byte swizzle is the warps' chunk ^ (row % 8) only for 128-byte rows
    use_tma = page % BLOCK_N == 0 and head_dim == 128
    num_q_heads = num_kv_heads * group
    kv_dtype = "float8_e4m3fn"
    accum = "float32"
    chunks = head_dim // 16  # 16-byte chunks per token row: producer threads per row, and the swizzle
    rows_per_pass = 128 // chunks
    row_passes = BLOCK_N // rows_per_pass
    assert 128 % chunks == 0 and BLOCK_N % rows_per_pass == 0, head_dim
    d = head_dim
    # the consumers' registers; the producer keeps the rest of the CTA's share (setmaxnreg)
    share = 65536 // (256 * blocks_per_sm) // 8 * 8  # a thread's registers at that occupancy
    consumer_regs = min(240, share + 32)
    bf16 = "true" if q_dtype == "bfloat16" else "false"

    batch = T.dynamic("batch")
    num_slots = T.dynamic("num_slots")
    table_rows = T.dynamic("table_rows")
    table_width = T.dynamic("table_width")
    num_splits = T.dynamic("num_splits")
    q_stride = T.dynamic("q_stride")  # q is often the q slice of the fused qkv projection's output
    out_stride = T.dynamic("out_stride")

    @T.macro
    def lookup(Table, row, slots, j, tile_start, last, lane_row):
        """This thread's slots of one tile into slots[j] (past the split's end: its last token again)."""
        for r in T.unroll(row_passes):
            pos = T.min(tile_start + r * rows_per_pass + lane_row, last)
            slots[j, r] = T.cast(Table[row, pos], "int64")

    @T.macro
    def gather(K, V, k_ring, v_ring, s, slots, j, kvh, lane_row, lane_chunk):
        """A tile's K and V rows by cp.async, 16 bytes a thread, into ring slot s in the warps' swizzle
        (applied here; with TMA the ring's layout annotation applies it)."""
        for r in T.unroll(row_passes):
            tok = r * rows_per_pass + lane_row
            col = lane_chunk * 16 if use_tma else (lane_chunk ^ (tok % chunks)) * 16
            T.ptx_cp_async(
                T.access_ptr(k_ring[s, tok, col], "w", 16),
                T.access_ptr(K[slots[j, r], kvh, lane_chunk * 16], "r", 16),
                16,
            )
            T.ptx_cp_async(
                T.access_ptr(v_ring[s, tok, col], "w", 16),
                T.access_ptr(V[slots[j, r], kvh, lane_chunk * 16], "r", 16),
                16,
            )

    @T.macro
    def locate(item, Rows, SeqLens, at):
        """Work item -> at = (kv head, batch row, its table row, split start, split end, tiles, split). A row's
        kv heads are neighbours in the item order, so the CTAs reading one token's 1 KB of K (and of V)
        run together: 1-3% over rows-first on the H200 (docs/PERF.md)."""
        bid = (item // num_kv_heads) % batch
        sid = item // (num_kv_heads * batch)
        seq_len = T.cast(SeqLens[bid], "int32")
        # split boundaries on tile multiples (stage 2 recomputes them); a split past the end is empty
        per_split = T.ceildiv(T.ceildiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        at[0] = item % num_kv_heads
        at[1] = bid
        at[2] = T.cast(Rows[bid], "int32")
        at[3] = sid * per_split
        at[4] = T.min(sid * per_split + per_split, seq_len)
        at[5] = T.ceildiv(T.max(at[4] - at[3], 0), BLOCK_N)
        at[6] = sid

    @T.prim_func
    def gqa_decode_fp8(
        Q: T.StridedTensor([batch, num_q_heads, head_dim], [q_stride, head_dim, 1], q_dtype),
        K: T.Tensor([num_slots, num_kv_heads, head_dim], kv_dtype),
        V: T.Tensor([num_slots, num_kv_heads, head_dim], kv_dtype),
        Table: T.Tensor([table_rows, table_width], table_dtype),
        Rows: T.Tensor([batch], rows_dtype),
        SeqLens: T.Tensor([batch], lens_dtype),
        MidO: T.Tensor([batch, num_q_heads, num_splits, head_dim], accum),
        MidLse: T.Tensor([batch, num_q_heads, num_splits], accum),
        Out: T.StridedTensor([batch, num_q_heads, head_dim], [out_stride, head_dim, 1], q_dtype),
    ):
        # one work item per (kv head, row, split). Persistent (ctas > 0): `ctas` CTAs take every ctas-th
        # item, and the ring runs on across items, so the producer gathers the next item's first tiles
        # while the consumers still finish the last one; otherwise one CTA per item
        items = num_kv_heads * batch * num_splits
        with T.Kernel(ctas if ctas else items, threads=256) as cta:
            T.import_source(_WARP_SOURCE)
            T.annotate_min_blocks_per_sm(blocks_per_sm)  # registers capped so that two CTAs share an SM
            k_ring = T.alloc_shared([stages, BLOCK_N, head_dim], kv_dtype)
            v_ring = T.alloc_shared([stages, BLOCK_N, head_dim], kv_dtype)
            o_merge = T.alloc_shared([4 * 8 * head_dim], accum)  # the warps' partial O; m and l: their
            # running maxima and row sums (gqa_fp8_warp.cuh `finish` merges them)
            m_merge = T.alloc_shared([32], accum)
            l_merge = T.alloc_shared([32], accum)
            ready = T.alloc_barrier(arrive_count=[128] * stages)  # producer -> consumers, per stage
            free = T.alloc_barrier(arrive_count=[128] * stages)  # consumers -> producer
            my_items = T.ceildiv(T.max(items - cta, 0), ctas) if ctas else 1
            at = T.alloc_local([7], "int32")
            done = T.alloc_var("int32", init=0)  # tiles of earlier items: the ring's running position
            tx = T.get_thread_binding()
            if use_tma:  # the TMA unit writes 128-byte swizzled rows; the gather's addresses follow
                T.annotate_layout(
                    {
                        k_ring: make_full_bank_swizzled_layout(k_ring),
                        v_ring: make_full_bank_swizzled_layout(v_ring),
                    }
                )

            if tx < 128:  # consumers: gqa_fp8_warp.cuh, a warp per 16 tokens of each tile
                T.set_max_nreg(consumer_regs, 1)
                warp = tx // 32
                lane = tx % 32
                qa = T.alloc_local([d // 8], "uint32")
                kr = T.alloc_local([d // 8], "uint32")
                vr = T.alloc_local([d // 8], "uint32")
                acc = T.alloc_local([d // 4], accum)
                ml = T.alloc_local([4], accum)  # running maxima and row sums of the thread's two heads
                for i in T.serial(my_items):
                    locate(cta + i * ctas if ctas else cta, Rows, SeqLens, at)
                    kvh, bid, start, end, num_tiles, sid = at[0], at[1], at[3], at[4], at[5], at[6]
                    for j in T.unroll(d // 4):
                        acc[j] = 0
                    ml[0] = -(2**30)  # finite: exp2(m_prev - m_new) must not be inf - inf
                    ml[1] = -(2**30)
                    ml[2] = 0
                    ml[3] = 0
                    T.call_extern(
                        "handle", f"gqa_fp8::load_q<{d}, {bf16}>", T.address_of(Q[bid, kvh * group, 0]), group,
                        T.address_of(qa[0]), lane,
                    )  # fmt: skip
                    for t in T.serial(num_tiles):
                        s = (done + t) % stages
                        T.barrier_wait(ready[s], ((done + t) // stages) & 1)
                        T.call_extern(
                            "handle", f"gqa_fp8::load_kv<{d}>", T.address_of(k_ring[s, 0, 0]),
                            T.address_of(v_ring[s, 0, 0]), T.address_of(kr[0]), T.address_of(vr[0]), warp, lane,
                        )  # fmt: skip
                        T.barrier_arrive(free[s])
                        T.call_extern(
                            "handle", f"gqa_fp8::attend<{d}>", T.address_of(kr[0]), T.address_of(vr[0]),
                            T.address_of(qa[0]), T.address_of(acc[0]), T.address_of(ml[0]), warp, lane,
                            start + t * BLOCK_N, end, sm_scale,
                        )  # fmt: skip
                    T.call_extern(
                        "handle", f"gqa_fp8::finish<{d}, {str(direct).lower()}, {bf16}>", T.address_of(acc[0]),
                        T.address_of(ml[0]), T.address_of(o_merge[0]), T.address_of(m_merge[0]),
                        T.address_of(l_merge[0]), tx, group,
                        T.address_of(Out[bid, kvh * group, 0]) if direct else T.address_of(MidO[bid, kvh * group, sid, 0]),
                        T.cast(d if direct else num_splits * d, "int64"),
                        T.address_of(MidLse[bid, kvh * group, sid]), T.cast(num_splits, "int64"),
                    )  # fmt: skip
                    done = done + num_tiles
            else:  # producer: 16 bytes a thread and cp.async, `chunks` threads per token row
                T.set_max_nreg(2 * share - consumer_regs, 0)
                p = tx - 128
                lane_row = p // chunks
                lane_chunk = p % chunks
                # The slots of tile t are read `ahead` tiles before its copies are issued (unrolled, so
                # slots[j] stays in registers): the table read's round trip, about as long as a tile's
                # copies under load, otherwise bounds the tiles a CTA has in flight.
                slots = T.alloc_local([ahead, row_passes], "int64")
                for i in T.serial(my_items):
                    locate(cta + i * ctas if ctas else cta, Rows, SeqLens, at)
                    kvh, row, start, num_tiles = at[0], at[2], at[3], at[5]
                    last = T.max(at[4] - 1, 0)
                    for j in T.unroll(ahead):
                        lookup(Table, row, slots, j, start + j * BLOCK_N, last, lane_row)
                    for g in T.serial(T.ceildiv(num_tiles, ahead)):
                        for j in T.unroll(ahead):
                            t = g * ahead + j
                            if t < num_tiles:
                                s = (done + t) % stages
                                T.barrier_wait(free[s], (((done + t) // stages) & 1) ^ 1)
                                if use_tma and start + t * BLOCK_N + BLOCK_N <= at[4]:
                                    # a whole page: its slots are consecutive from the tile's first
                                    base = slots[j, 0] - lane_row
                                    # no L2 evict-first hint (MLA's): with it these reads were up to
                                    # 5% slower than the gather at 32+ tiles a row (PERF.md)
                                    page_k = K[base : base + BLOCK_N, kvh, 0:head_dim]
                                    page_v = V[base : base + BLOCK_N, kvh, 0:head_dim]
                                    T.tma_copy(page_k, k_ring[s, :, :], barrier=ready[s])
                                    T.tma_copy(page_v, v_ring[s, :, :], barrier=ready[s])
                                    T.barrier_arrive(ready[s])
                                else:
                                    gather(K, V, k_ring, v_ring, s, slots, j, kvh, lane_row, lane_chunk)
                                    T.cp_async_barrier_noinc(ready[s])
                                lookup(Table, row, slots, j, start + (t + ahead) * BLOCK_N, last, lane_row)
                    done = done + num_tiles

    return tilelang.compile(gqa_decode_fp8, target="cuda", pass_configs={"tl.enable_fast_math": True})


_WARP_SOURCE = (Path(__file__).parent / "gqa_fp8_warp.cuh").read_text()


def stage1(q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_splits, out=None, page_size=1):
    """`triton.stage1`'s contract (partial outputs [B, Hq, splits, D] and their base-2 LSE, float32) for
    what `supported` covers; split boundaries are multiples of BLOCK_N (tell stage 2). With `out` (one
    split, heads dense): the attention output goes straight to `out`, and the partials are not written.
    `page_size`: the pool's (whole pages of 64 tokens arrive by TMA)."""
    batch, num_q_heads, head_dim = q.shape
    direct = out is not None
    assert not direct or (num_splits == 1 and out.stride(1) == head_dim and out.stride(2) == 1)
    num_kv_heads = k_pool.shape[1]
    assert k_pool.is_contiguous() and v_pool.is_contiguous(), "K/V pools are [slots, kv heads, dim], dense"
    assert q.stride(1) == head_dim and q.stride(2) == 1 and req_to_token.stride(1) == 1
    req_to_token = req_to_token.contiguous()  # a no-op for the engine's table
    ctas = BLOCKS_PER_SM * num_sms(q.device)
    kernel = _kernel(
        num_kv_heads, num_q_heads // num_kv_heads, head_dim, _TL_DTYPE[q.dtype], _TL_DTYPE[req_to_token.dtype],
        _TL_DTYPE[rows.dtype], _TL_DTYPE[seq_lens.dtype], float(scale * LOG2E),
        ctas if batch * num_kv_heads * num_splits > ctas else 0, direct, BLOCK_N if page_size % BLOCK_N == 0 else 1,
    )  # fmt: skip
    mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    if batch:
        kernel(q, k_pool, v_pool, req_to_token, rows, seq_lens, mid_o, mid_lse, q if out is None else out)
    return mid_o, mid_lse


def decode_attention(
    q, k_pool, v_pool, req_to_token, rows, seq_lens, scale, num_splits=None, out=None, page_size=1, q_len=1
):
    """`DecodeAttention`. An fp8 pool that `supported` covers runs this stage 1: with one split it
    writes the output itself, otherwise Triton's stage 2 merges the splits. Anything else (16-bit pools,
    float32 tests) runs the Triton kernel whole."""
    from runtime.gpu.kernels.decode_attention import triton

    args = (q, k_pool, v_pool, req_to_token, rows, seq_lens, scale)
    if q_len > 1 or not supported(q, k_pool):  # (verify steps: the Triton kernel's query tiles)
        return triton.decode_attention(*args, num_splits, out, q_len=q_len)
    paged = functools.partial(stage1, page_size=page_size)
    return triton.split_kv(paged, BLOCK_N, *args, num_splits, out, direct=True)

"""MLA decode (absorbed, DeepSeek-V2/V3) on the paged latent cache in TileLang, in FlashMLA's shape: the
kernel builder. The host side (availability, split count, the launcher) is `tilelang.py`.

Why a second kernel next to `triton.py`: at h_q = 128 decode is compute-bound (two GEMMs per KV tile
for every head), and Hopper's tensor cores only run at full rate through wgmma, whose M tile is 64 rows
issued by a whole warpgroup. Triton's 16-head programs use mma.sync; this kernel puts 64 q heads in a
CTA so each KV tile is read from memory once per 64 heads and feeds two 64-row wgmma GEMMs.

One CTA per (block of 64 q heads, batch row, KV split); 384 threads = three warpgroups: two consumers
(WG0, WG1), each owning half of O's 512 columns (128 accumulator registers a thread), and a producer
(WG2) that copies each 64-token tile's 576-wide latent rows into one of two shared KV buffers. The
values are the first 512 columns of the same shared tile, so each KV byte is read once (keys and
values). Tokens past the split's end re-read its last token (finite data; their scores are -inf), so
a ragged tail never reads a slot the row does not own. Two schedules, by page size (`tiled`;
docs/PERF.md):
- Any page size that does not hold whole 64-token tiles (the engine's per-token table):
  `tilelang_roles.py`, the FlashMLA / TileLang `example_mla_decode_ws` division of labour, every tile
  gathered by cp.async. The seesaw lost on the gather at 1K and at h_q = 16.
- Pages of a multiple of 64 tokens (a FlashMLA block table, `--page-size 64`): `tilelang_seesaw.py`,
  FlashMLA's dense-decode schedule, whole tiles by TMA (+3-4% over the gather there): WG0 and WG1 each
  own one tile of a pair and half of O, so both do the same FLOPs and one's softmax runs under the
  other's GEMMs (+4-7% at h_q = 128 and 4K-32K on the H200, two runs).
Timed and removed (git history has them): per-part ready/free barriers ("chunked") and P to WG1
before WG0's own PV half ("early_p"), no gain worth a default; TMA in the three-role schedule, and
the seesaw on the gather; the diagnostics that skipped the copies or the math ("no_load",
"no_compute"); the seesaw variants listed in `tilelang_seesaw.py` and docs/PERF.md.

One split: the CTA writes the output and the LSE. More: it writes a normalised float32 partial and its
base-2 LSE, and a combine kernel (one CTA per (head, row)) merges the splits. The split count is chosen
on the host (no sync) so the grid fills the SMs; pass a fixed one under CUDA graphs.

Verify steps (q_len > 1 query tokens per row, at its last q_len positions) put the q_len * h_q query
rows of a row in the head dimension: virtual head v is query token v // h_q's head v % h_q, and sees
the keys before position seq_len - q_len + 1 + v // h_q (`key_end`). So each KV tile is still read
once per 64 query rows, and at h_q = 16, k = 3 one CTA holds all four tokens' heads.

Kernels are compiled on first use per (heads, q_len, dims, dtypes, page, split or not, scale); batch,
pool size, table shape and split count are dynamic, so a serving run compiles a handful of variants."""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations
# (T.Tensor shapes built from local variables) at decoration time.
import functools

from runtime.gpu.kernels.mla_decode.tilelang_tiles import BLOCK_H, BLOCK_N, LN2, PASS_CONFIGS, tiled


@functools.cache
def kernel(
    num_heads: int,
    q_len: int,
    d_v: int,
    d_pe: int,
    dtype: str,
    table_dtype: str,
    rows_dtype: str,
    lens_dtype: str,
    page: int,
    split: bool,
    sm_scale: float,
):
    """Compile one variant (see the module doc). `sm_scale` is the softmax scale times log2(e). The kernel's
    Q, Out and Lse have num_heads * q_len heads a row (a [rows * q_len, num_heads, ...] tensor's view)."""
    import tilelang
    import tilelang.language as T

    from runtime.gpu.kernels.mla_decode import tilelang_roles, tilelang_seesaw

    assert d_v % 128 == 0 and d_pe % 8 == 0 and d_pe <= 64, (d_v, d_pe)
    dim = d_v + d_pe
    half = d_v // 2  # each consumer warpgroup owns half of the output columns
    pos_heads, num_heads = num_heads, num_heads * q_len  # the model's heads; the kernel's virtual heads
    head_blocks = -(-num_heads // BLOCK_H)
    valid_h = min(BLOCK_H, num_heads)
    accum = "float32"

    batch = T.dynamic("batch")
    num_slots = T.dynamic("num_slots")
    table_rows = T.dynamic("table_rows")
    table_width = T.dynamic("table_width")
    num_splits = T.dynamic("num_splits") if split else 1

    def key_end(end, seq_len, head):
        """The end of the keys virtual `head` attends within a split ending at `end`: its query token's
        own position + 1 (decode: the split's end)."""
        if q_len == 1:
            return end
        return T.min(end, seq_len - (q_len - 1) + head // pos_heads)

    @T.macro
    def write_lse(Lse, MidLse, bid, h0, sid, sums, m_i):
        """The rows' log-sum-exp from their sums and running max: base 2 per split (the combine merges
        them), else natural log; -inf for an empty split."""
        for h_i in T.Parallel(BLOCK_H):
            if h_i < valid_h:
                lse2 = T.if_then_else(
                    sums[h_i] > 0, T.log2(sums[h_i]) + m_i[h_i] * sm_scale, -T.infinity(accum)
                )
                if split:
                    MidLse[bid, h0 + h_i, sid] = lse2
                else:
                    Lse[bid, h0 + h_i] = lse2 * LN2

    @T.macro
    def write_out(Out, MidO, bid, h0, sid, acc_o, inv, O_half, col0):
        """A consumer's half of O (columns col0..col0 + half) divided by the row sums: a float32 partial
        per split, else through shared memory (O_half, Q's buffer by then) into Out."""
        if split:
            for h_i, d_i in T.Parallel(BLOCK_H, half):
                if h_i < valid_h:
                    MidO[bid, h0 + h_i, sid, col0 + d_i] = acc_o[h_i, d_i] * inv[h_i]
        else:
            for h_i, d_i in T.Parallel(BLOCK_H, half):
                acc_o[h_i, d_i] *= inv[h_i]
            T.copy(acc_o, O_half)
            for h_i, d_i in T.Parallel(BLOCK_H, half):
                if h_i < valid_h:
                    Out[bid, h0 + h_i, col0 + d_i] = O_half[h_i, d_i]

    def shared_tiles():
        """Both schedules' big shared buffers (allocated at trace time, in the kernel's frame): Q's two
        value halves, then two KV buffers, each a left and a right value half and the rope tail."""
        return (
            T.alloc_shared([BLOCK_H, half], dtype),
            T.alloc_shared([BLOCK_H, half], dtype),
            *[T.alloc_shared([BLOCK_N, half], dtype) for _ in range(4)],
            *[T.alloc_shared([BLOCK_N, d_pe], dtype) for _ in range(2)],
        )

    @T.macro
    def combine(MidO, MidLse, Out, Lse):
        """Merge the splits of one (row, head): weights exp2(lse_s - max), 4 columns a thread."""
        with T.Kernel(num_heads, batch, threads=d_v // 4) as (h, bid):
            tx = T.get_thread_binding()
            top = T.alloc_var(accum, init=-T.infinity(accum))
            total = T.alloc_var(accum, init=0)
            acc = T.alloc_local([4], accum)
            for s in T.serial(num_splits):
                top = T.max(top, MidLse[bid, h, s])
            base = T.if_then_else(top > -T.infinity(accum), top, 0)
            for s in T.serial(num_splits):
                total += T.exp2(MidLse[bid, h, s] - base)
            for v in T.vectorized(4):
                acc[v] = 0
            for s in T.serial(num_splits):
                w = T.exp2(MidLse[bid, h, s] - base)
                for v in T.vectorized(4):
                    acc[v] += w * MidO[bid, h, s, tx * 4 + v]
            scale_out = T.if_then_else(total > 0, 1.0 / total, 0)
            for v in T.vectorized(4):
                Out[bid, h, tx * 4 + v] = acc[v] * scale_out
            if tx == 0:
                Lse[bid, h] = T.if_then_else(total > 0, (T.log2(total) + base) * LN2, -T.infinity(accum))

    schedule = tilelang_seesaw if tiled(page) else tilelang_roles
    attend = schedule.attend(
        num_heads=num_heads, d_v=d_v, d_pe=d_pe, half=half, head_blocks=head_blocks, dtype=dtype, accum=accum,
        page=page, sm_scale=sm_scale, batch=batch, num_splits=num_splits, write_lse=write_lse,
        write_out=write_out, shared_tiles=shared_tiles, key_end=key_end,
    )  # fmt: skip

    if split:

        @T.prim_func
        def mla_decode_split(
            Q: T.Tensor([batch, num_heads, dim], dtype),
            KV: T.Tensor([num_slots, dim], dtype),
            Table: T.Tensor([table_rows, table_width], table_dtype),
            Rows: T.Tensor([batch], rows_dtype),
            SeqLens: T.Tensor([batch], lens_dtype),
            MidO: T.Tensor([batch, num_heads, num_splits, d_v], accum),
            MidLse: T.Tensor([batch, num_heads, num_splits], accum),
            Out: T.Tensor([batch, num_heads, d_v], dtype),
            Lse: T.Tensor([batch, num_heads], accum),
        ):
            attend(Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse)
            combine(MidO, MidLse, Out, Lse)

        func = mla_decode_split
    else:

        @T.prim_func
        def mla_decode_direct(
            Q: T.Tensor([batch, num_heads, dim], dtype),
            KV: T.Tensor([num_slots, dim], dtype),
            Table: T.Tensor([table_rows, table_width], table_dtype),
            Rows: T.Tensor([batch], rows_dtype),
            SeqLens: T.Tensor([batch], lens_dtype),
            Out: T.Tensor([batch, num_heads, d_v], dtype),
            Lse: T.Tensor([batch, num_heads], accum),
        ):
            attend(Q, KV, Table, Rows, SeqLens, Out, Lse, None, None)

        func = mla_decode_direct

    return tilelang.compile(func, target="cuda", pass_configs=PASS_CONFIGS)

"""MLA decode (absorbed, DeepSeek-V2/V3) on the paged latent cache in TileLang, in FlashMLA's shape.

Why a second kernel next to `triton.py`: at h_q = 128 decode is compute-bound (two GEMMs per KV tile
for every head), and Hopper's tensor cores only run at full rate through wgmma, whose M tile is 64 rows
issued by a whole warpgroup. Triton's 16-head programs use mma.sync; this kernel puts 64 q heads in a
CTA so each KV tile is read from memory once per 64 heads and feeds two 64-row wgmma GEMMs.

One CTA per (block of 64 q heads, batch row, KV split); 384 threads = three warpgroups with fixed roles
(the FlashMLA / TileLang `example_mla_decode_ws` division of labour):

- WG2, the producer: walks the split 64 tokens at a time and gathers each token's 576-wide latent
  row into one of two shared KV buffers with cp.async (8 threads per row, 16 B each). The slot of token
  `pos` is `table[row, pos // PAGE] * PAGE + pos % PAGE`: PAGE = 1 is the engine's per-token
  req_to_token, PAGE = 64 a FlashMLA block table; a gather serves both, so slots need no alignment.
  Tokens past the split's end re-read its last token (finite data; their scores are -inf), so a
  ragged tail never reads a slot the row does not own. The buffer's "ready" mbarrier fires when the
  copies land (cp.async.mbarrier.arrive.noinc); its "free" mbarrier, when both consumers are done.
- WG0: S = Q K^T for the tile (wgmma 64 x 64 x 576, Q resident in shared memory), online softmax in
  float32 base 2 (scores past the end start at -inf), then P (bf16) and the per-head rescale factor go
  to shared memory and WG0 does O[:, :256] += P V[:, :256].
- WG1: waits for P, rescales and does O[:, 256:] += P V[:, 256:]. Splitting O by columns keeps each
  consumer's accumulator at 128 registers a thread (64 x 256 float32 over 128 threads).

The values are the first 512 columns of the same shared tile, so each KV byte is read once (keys and
values). setmaxnreg moves registers from the producer to the consumers (240 / 168 / 72).

One split: the CTA writes the output and the LSE. More: it writes a normalised float32 partial and its
base-2 LSE, and a combine kernel (one CTA per (head, row)) merges the splits. The split count is chosen
on the host (no sync) so the grid fills the SMs; pass a fixed one under CUDA graphs.

Schedule options (`_kernel`'s `opts`; `DEFAULT_OPTS` is the one measured best, docs/PERF.md):
- "tma": whole tiles of a page-64 block table arrive by bulk copies (+3-4% there; the per-token table
  always gathers).
- "seesaw" (FlashMLA's dense-decode division of labour, see the comment above `attend_seesaw`): WG0
  and WG1 each own one tile of a pair and half of O, so both do the same FLOPs and one's softmax runs
  under the other's GEMMs. With TMA, +4-7% at h_q = 128 and 4K-32K (H200, two runs); on the gather it
  lost at 1K and at h_q = 16, so it applies with TMA only (the engine's per-token table keeps the
  schedule above).
- "chunked" (per-part ready/free barriers) and "early_p" (P to WG1 before WG0's own PV half): timed,
  no gain worth a default. With seesaw, per-64-column ready barriers, issuing the next pair's QK^T
  ahead of the last PV and reordering the producer were timed too (4% slower, equal, equal) and
  removed; so were the variants listed in docs/PERF.md (TMA multicast in a 2-CTA cluster among them,
  and FlashMLA's own issue order: each warpgroup's next S queued behind its last PV, with per-part
  barriers and consumer-issued copies, 9-10% slower; WG1's S_B moved behind its P_A V_A-right, so
  that B's refill has slack, 6-8% slower: the math alone lost 3-4%).
The seesaw's hand-offs between WG0 and WG1 are named barriers (see M0_READY) and its KV copies carry an
evict-first hint. Measured on the H200 at h_q = 128: the seesaw math alone (no loads) runs at 624-650
TFLOP/s, with the loads 515-537: the two 72 KB KV buffers (all that fits beside Q) leave one tile pair
of prefetch, and each half is refilled only after its last reader of the pair, so the next pair waits
for part of the copy's latency (a clock64 timeline of the waits is in PERF.md). That is the remaining
gap to FlashMLA: with every tile in L2 the same kernel reads 586 TFLOP/s at 4K, 101% of FlashMLA's
figure; L2 prefetch half a pair ahead did not recover it.

Kernels are compiled on first use per (heads, dims, dtypes, page, split or not, scale, schedule); batch,
pool size, table shape and split count are dynamic, so a serving run compiles a handful of variants."""

# No `from __future__ import annotations`: TileLang reads the prim_func parameter annotations
# (T.Tensor shapes built from local variables) at decoration time.
import functools

import torch

from runtime.gpu.kernels.common import LOG2E, MAX_SPLITS, MIN_SPLIT_TOKENS, num_sms
from runtime.gpu.kernels.mla_decode.reference import pool_2d
from runtime.gpu.kernels.registry import is_hopper as _hopper
from runtime.gpu.kernels.registry import tilelang_importable as _importable

BLOCK_H = 64  # q heads per CTA: the wgmma M tile (fewer heads are zero-padded)
BLOCK_N = 64  # tokens per KV tile
# The seesaw's four per-pair hand-offs between its consumer warpgroups are hardware named barriers
# (bar.arrive by the writer, bar.sync by the reader, 256 threads), as in FlashMLA: 1.5-3% faster at
# h_q = 128 than mbarriers (H200, timed round-robin; PERF.md). They need no phase: a writer cannot
# arrive for pair i + 1 before the reader's sync of pair i, since each warpgroup waits for the other
# once per pair in between. TileLang's own syncs in this kernel use ids 0, 3 and 4.
M0_READY, M1_READY, P0_READY, P1_READY = 8, 9, 10, 11
LN2 = 0.6931471805599453
DEFAULT_OPTS: tuple[str, ...] = ("seesaw", "tma")  # the schedule measured best on the H200 (PERF.md)

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


def schedule(opts: tuple[str, ...], page: int) -> tuple[str, ...]:
    """The options that apply at this page size, sorted (one compiled variant per distinct schedule):
    TMA needs whole 64-token tiles in a page, and the seesaw schedule only pays with TMA."""
    tiled = page % BLOCK_N == 0
    return tuple(sorted(o for o in opts if o not in ("tma", "seesaw") or tiled))


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


@functools.cache
def _kernel(
    num_heads: int,
    d_v: int,
    d_pe: int,
    dtype: str,
    table_dtype: str,
    rows_dtype: str,
    lens_dtype: str,
    page: int,
    split: bool,
    sm_scale: float,
    opts: tuple[str, ...] = DEFAULT_OPTS,
):
    """Compile one variant (see the module doc). `sm_scale` is the softmax scale times log2(e).

    `opts` (a sorted tuple): "early_p": WG0 hands P to WG1 before, not after, its own half of PV;
    "chunked": each KV buffer is three parts (rope tail, left and right value
    halves) with their own ready / free barriers, so QK^T starts on the first part while the rest
    lands and each part is refilled as soon as its last reader is done; "tma": with pages of a
    multiple of 64 tokens, full tiles arrive by TMA (one bulk copy per part) instead of the cp.async
    gather. Diagnostics (wrong results, for timing): "no_load" skips the copies, "no_compute" the math."""
    import tilelang
    import tilelang.language as T

    assert d_v % 128 == 0 and d_pe % 8 == 0 and d_pe <= 64, (d_v, d_pe)
    assert set(opts) <= {"early_p", "chunked", "seesaw", "tma", "no_load", "no_compute"}, opts
    seesaw = "seesaw" in opts
    assert not (seesaw and ({"early_p", "chunked", "no_compute"} & set(opts))), opts
    early_p = "early_p" in opts
    chunked = "chunked" in opts
    use_tma = "tma" in opts and page % BLOCK_N == 0
    load = "no_load" not in opts
    compute = "no_compute" not in opts
    dim = d_v + d_pe
    half = d_v // 2  # each consumer warpgroup owns half of the output columns
    head_blocks = -(-num_heads // BLOCK_H)
    valid_h = min(BLOCK_H, num_heads)
    accum = "float32"

    batch = T.dynamic("batch")
    num_slots = T.dynamic("num_slots")
    table_rows = T.dynamic("table_rows")
    table_width = T.dynamic("table_width")
    num_splits = T.dynamic("num_splits") if split else 1

    @T.macro
    def gather_copies(KV, slots, dst, col0, width, lane_row, lane_col):
        """cp.async 16 B per thread and row (8 threads per token row, 16 rows per pass)."""
        for r in T.unroll(BLOCK_N // 16):
            for u in T.unroll(-(-width // 64)):
                if width % 64 == 0 or 64 * u + lane_col < width:
                    if load:
                        T.ptx_cp_async(
                            T.access_ptr(dst[r * 16 + lane_row, 64 * u + lane_col], "w", 8),
                            T.access_ptr(KV[slots[r], col0 + 64 * u + lane_col], "r", 8),
                            8,
                        )

    @T.macro
    def gather_part(KV, slots, dst, col0, width, ready, lane_row, lane_col):
        """One part's copies, then an arrive on `ready` that fires once this thread's copies landed."""
        gather_copies(KV, slots, dst, col0, width, lane_row, lane_col)
        T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def load_part(KV, slots, dst, col0, width, ready, lane_row, lane_col, full, base):
        if use_tma:
            if full:  # a whole tile inside one page: one bulk copy, the TMA unit swizzles it
                if load:
                    T.tma_copy(KV[base : base + BLOCK_N, col0 : col0 + width], dst, barrier=ready[0])
                T.barrier_arrive(ready[0])
            else:  # the row's last, partial tile: the gather (its tail re-reads the last token)
                gather_part(KV, slots, dst, col0, width, ready, lane_row, lane_col)
        else:
            gather_part(KV, slots, dst, col0, width, ready, lane_row, lane_col)

    @T.macro
    def gather_all(KV, slots, kv_l, kv_r, k_tail, ready, lane_row, lane_col):
        for r in T.unroll(BLOCK_N // 16):
            t_row = r * 16 + lane_row
            for u in T.unroll(half // 64):  # 16 B per cp.async, no bounds check (slots are the caller's)
                if load:
                    T.ptx_cp_async(
                        T.access_ptr(kv_l[t_row, 64 * u + lane_col], "w", 8),
                        T.access_ptr(KV[slots[r], 64 * u + lane_col], "r", 8),
                        8,
                    )
                    T.ptx_cp_async(
                        T.access_ptr(kv_r[t_row, 64 * u + lane_col], "w", 8),
                        T.access_ptr(KV[slots[r], half + 64 * u + lane_col], "r", 8),
                        8,
                    )
            if lane_col < d_pe:
                if load:
                    T.ptx_cp_async(
                        T.access_ptr(k_tail[t_row, lane_col], "w", 8),
                        T.access_ptr(KV[slots[r], d_v + lane_col], "r", 8),
                        8,
                    )
        T.cp_async_barrier_noinc(ready[0])

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

    @T.macro
    def produce(KV, Table, row, slots, buf, tile_start, end, last, parity, tx):
        """Producer warpgroup: one tile into one KV buffer, the parts in the order QK^T reads them."""
        kv_l, kv_r, k_tail, ready_t, ready_l, ready_r, free_t, free_l, free_r = buf
        p = tx - 256
        lane_row = p // 8
        lane_col = (p % 8) * 8
        # Look the slots up before waiting for the buffer, so the table reads' latency hides under the
        # wait (the wait is a memory barrier the compiler will not hoist the loads across).
        for r in T.unroll(BLOCK_N // 16):
            pos = T.min(tile_start + r * 16 + lane_row, last)  # past the end: the last token again
            slots[r] = T.cast(Table[row, pos // page], "int64") * page + T.cast(pos % page, "int64")
        if use_tma:  # a full tile lies in one page (tile starts are multiples of 64, pages too)
            full = tile_start + BLOCK_N <= end
            base = T.cast(Table[row, tile_start // page], "int64") * page + T.cast(tile_start % page, "int64")
        else:
            full = False
            base = 0
        if chunked:
            T.barrier_wait(free_t[0], parity ^ 1)  # the tail's reader (QK^T) is done with it
            load_part(KV, slots, k_tail, d_v, d_pe, ready_t, lane_row, lane_col, full, base)
            T.barrier_wait(free_l[0], parity ^ 1)  # WG0 is done (QK^T and its PV half)
            load_part(KV, slots, kv_l, 0, half, ready_l, lane_row, lane_col, full, base)
            T.barrier_wait(free_r[0], parity ^ 1)  # WG1 is done (its PV half)
            load_part(KV, slots, kv_r, half, half, ready_r, lane_row, lane_col, full, base)
        else:
            T.barrier_wait(free_t[0], parity ^ 1)  # both consumers are done with this buffer
            if use_tma:
                if full:
                    if load:
                        T.tma_copy(KV[base : base + BLOCK_N, d_v:dim], k_tail, barrier=ready_t[0])
                        T.tma_copy(KV[base : base + BLOCK_N, 0:half], kv_l, barrier=ready_t[0])
                        T.tma_copy(KV[base : base + BLOCK_N, half:d_v], kv_r, barrier=ready_t[0])
                    T.barrier_arrive(ready_t[0])
                else:
                    gather_all(KV, slots, kv_l, kv_r, k_tail, ready_t, lane_row, lane_col)
            else:
                gather_all(KV, slots, kv_l, kv_r, k_tail, ready_t, lane_row, lane_col)

    @T.macro
    def score_tile(
        Q_l, Q_r, Q_tail, buf, acc_s, acc_o_l, m_i, m_prev, alpha, sumexp, sumexp_i, parity, tile_start, end,
    ):  # fmt: skip
        """WG0, one tile: S = Q K^T (part by part as they land), online softmax, O_left rescaled."""
        kv_l, kv_r, k_tail, ready_t, ready_l, ready_r, free_t, free_l, free_r = buf
        # masked scores start at -inf and stay there (wgmma accumulates into acc_s)
        for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
            acc_s[h_i, n_i] = T.if_then_else(tile_start + n_i < end, 0, -T.infinity(accum))
        T.barrier_wait(ready_t[0], parity)
        if compute:
            T.wgmma_gemm(Q_tail, k_tail, acc_s, transpose_B=True)
        if chunked:
            T.barrier_wait(ready_l[0], parity)
        if compute:
            T.wgmma_gemm(Q_l, kv_l, acc_s, transpose_B=True)
        if chunked:
            T.barrier_wait(ready_r[0], parity)
        if compute:
            T.wgmma_gemm(Q_r, kv_r, acc_s, transpose_B=True)
            T.wait_wgmma(0)
        if chunked:
            T.barrier_arrive(free_t[0])
        if compute:
            T.copy(m_i, m_prev)
            T.reduce_max(acc_s, m_i, dim=1, clear=False)  # running max of the raw scores
            for h_i in T.Parallel(BLOCK_H):
                alpha[h_i] = T.exp2((m_prev[h_i] - m_i[h_i]) * sm_scale)
            for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
                acc_s[h_i, n_i] = T.exp2(acc_s[h_i, n_i] * sm_scale - m_i[h_i] * sm_scale)
            T.reduce_sum(acc_s, sumexp_i, dim=1)
            for h_i in T.Parallel(BLOCK_H):
                sumexp[h_i] = sumexp[h_i] * alpha[h_i] + sumexp_i[h_i]
            for h_i, d_i in T.Parallel(BLOCK_H, half):
                acc_o_l[h_i, d_i] *= alpha[h_i]

    @T.macro
    def publish_and_accumulate(acc_s, S_shared, alpha, alpha_shared, buf, acc_o_l, sS_ready):
        """WG0: P and alpha to shared for WG1, then O_left += P V_left."""
        kv_l, kv_r, k_tail, ready_t, ready_l, ready_r, free_t, free_l, free_r = buf
        T.copy(alpha, alpha_shared)
        T.copy(acc_s, S_shared)
        if early_p:  # WG1's half of PV runs alongside WG0's, so the buffer frees one PV sooner
            T.fence_proxy_async()  # P was written by plain stores; WG1's wgmma reads it (async proxy)
            T.barrier_arrive(sS_ready)
        if compute:
            T.gemm(S_shared, kv_l, acc_o_l)
        if not early_p:
            T.barrier_arrive(sS_ready)
        T.barrier_arrive(free_l[0])

    @T.macro
    def accumulate_right(S_shared, alpha_shared, buf, acc_o_r, sS_ready, sS_free, parity, last_tile):
        """WG1, one tile: wait for P, rescale O_right, O_right += P V_right."""
        kv_l, kv_r, k_tail, ready_t, ready_l, ready_r, free_t, free_l, free_r = buf
        T.barrier_arrive(sS_ready)
        T.barrier_wait(sS_ready, parity)
        if compute:
            for h_i, d_i in T.Parallel(BLOCK_H, half):
                acc_o_r[h_i, d_i] *= alpha_shared[h_i]
            T.gemm(S_shared, kv_r, acc_o_r)
        T.barrier_arrive(free_r[0])
        if not last_tile:
            T.barrier_arrive(sS_free)

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
    def attend(Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse):
        with T.Kernel(head_blocks, batch, num_splits, threads=384) as (hb, bid, sid):
            Q_l, Q_r, kv0_l, kv0_r, kv1_l, kv1_r, k0_tail, k1_tail = shared_tiles()
            Q_tail = T.alloc_shared([BLOCK_H, d_pe], dtype)
            S_shared = T.alloc_shared([BLOCK_H, BLOCK_N], dtype)
            alpha_shared = T.alloc_shared([BLOCK_H], accum)
            inv_shared = T.alloc_shared([BLOCK_H], accum)
            O_l = Q_l  # the output tile reuses Q's buffers once the last S is computed
            O_r = Q_r

            acc_s = T.alloc_fragment([BLOCK_H, BLOCK_N], accum)
            acc_o_l = T.alloc_fragment([BLOCK_H, half], accum)
            acc_o_r = T.alloc_fragment([BLOCK_H, half], accum)
            m_i = T.alloc_fragment([BLOCK_H], accum)
            m_prev = T.alloc_fragment([BLOCK_H], accum)
            alpha = T.alloc_fragment([BLOCK_H], accum)
            sumexp = T.alloc_fragment([BLOCK_H], accum)
            sumexp_i = T.alloc_fragment([BLOCK_H], accum)
            inv = T.alloc_fragment([BLOCK_H], accum)

            # producer -> consumers "ready", consumers -> producer "free", per buffer (and per part
            # when chunked; otherwise one barrier stands for all three parts)
            if chunked:
                ready0_t = T.alloc_barrier(arrive_count=128)
                ready0_l = T.alloc_barrier(arrive_count=128)
                ready0_r = T.alloc_barrier(arrive_count=128)
                ready1_t = T.alloc_barrier(arrive_count=128)
                ready1_l = T.alloc_barrier(arrive_count=128)
                ready1_r = T.alloc_barrier(arrive_count=128)
                free0_t = T.alloc_barrier(arrive_count=128)  # WG0 after QK^T
                free0_l = T.alloc_barrier(arrive_count=128)  # WG0 after its PV half
                free0_r = T.alloc_barrier(arrive_count=128)  # WG1 after its PV half
                free1_t = T.alloc_barrier(arrive_count=128)
                free1_l = T.alloc_barrier(arrive_count=128)
                free1_r = T.alloc_barrier(arrive_count=128)
                buf0 = (kv0_l, kv0_r, k0_tail, ready0_t, ready0_l, ready0_r, free0_t, free0_l, free0_r)
                buf1 = (kv1_l, kv1_r, k1_tail, ready1_t, ready1_l, ready1_r, free1_t, free1_l, free1_r)
            else:
                ready0 = T.alloc_barrier(arrive_count=128)
                ready1 = T.alloc_barrier(arrive_count=128)
                free0 = T.alloc_barrier(arrive_count=256)  # WG0 and WG1 after their PV halves
                free1 = T.alloc_barrier(arrive_count=256)
                buf0 = (kv0_l, kv0_r, k0_tail, ready0, ready0, ready0, free0, free0, free0)
                buf1 = (kv1_l, kv1_r, k1_tail, ready1, ready1, ready1, free1, free1, free1)
            sS_ready = T.alloc_barrier(arrive_count=256)  # WG0 -> WG1: P and alpha are in shared
            sS_free = T.alloc_barrier(arrive_count=256)  # WG1 -> WG0: done reading them
            done = T.alloc_barrier(arrive_count=128)  # WG0 -> WG1: 1 / sum is in shared

            row = T.cast(Rows[bid], "int64")
            seq_len = T.cast(SeqLens[bid], "int32")
            # split boundaries on tile multiples; a split past the row's end gets no tiles
            per_split = T.ceildiv(T.ceildiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
            start = sid * per_split
            end = T.min(start + per_split, seq_len)
            num_tiles = T.ceildiv(T.max(end - start, 0), BLOCK_N)
            num_pairs = T.ceildiv(num_tiles, 2)  # two buffers: tiles go in pairs (an odd one pads)
            h0 = hb * BLOCK_H
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(240, 1)
                # Q into shared (rows past the heads zeroed: padded heads give finite junk rows)
                for h_i, d_i in T.Parallel(BLOCK_H, half):
                    Q_l[h_i, d_i] = T.if_then_else(h0 + h_i < num_heads, Q[bid, h0 + h_i, d_i], 0)
                for h_i, d_i in T.Parallel(BLOCK_H, half):
                    Q_r[h_i, d_i] = T.if_then_else(h0 + h_i < num_heads, Q[bid, h0 + h_i, half + d_i], 0)
                for h_i, d_i in T.Parallel(BLOCK_H, d_pe):
                    Q_tail[h_i, d_i] = T.if_then_else(h0 + h_i < num_heads, Q[bid, h0 + h_i, d_v + d_i], 0)
                T.fill(sumexp, 0)
                T.fill(m_i, -(2**30))  # finite: exp2(m_prev - m_new) must not be inf - inf
                T.fill(acc_o_l, 0)
                for i_i in T.serial(num_pairs):
                    # tile 2 i_i in buffer 0
                    score_tile(
                        Q_l, Q_r, Q_tail, buf0, acc_s, acc_o_l, m_i, m_prev, alpha, sumexp, sumexp_i,
                        i_i & 1, start + (2 * i_i) * BLOCK_N, end,
                    )  # fmt: skip
                    if i_i != 0:  # WG1 has finished reading the previous P
                        T.barrier_arrive(sS_free)
                        T.barrier_wait(sS_free, 1)
                    publish_and_accumulate(acc_s, S_shared, alpha, alpha_shared, buf0, acc_o_l, sS_ready)
                    # tile 2 i_i + 1 in buffer 1
                    score_tile(
                        Q_l, Q_r, Q_tail, buf1, acc_s, acc_o_l, m_i, m_prev, alpha, sumexp, sumexp_i,
                        i_i & 1, start + (2 * i_i + 1) * BLOCK_N, end,
                    )  # fmt: skip
                    T.barrier_arrive(sS_free)
                    T.barrier_wait(sS_free, 0)
                    publish_and_accumulate(acc_s, S_shared, alpha, alpha_shared, buf1, acc_o_l, sS_ready)
                # an empty split (row shorter than the split start) has sum 0: output 0, LSE -inf
                for h_i in T.Parallel(BLOCK_H):
                    inv[h_i] = T.if_then_else(sumexp[h_i] > 0, 1.0 / sumexp[h_i], 0)
                T.copy(inv, inv_shared)
                T.barrier_arrive(done)
                write_lse(Lse, MidLse, bid, h0, sid, sumexp, m_i)
                write_out(Out, MidO, bid, h0, sid, acc_o_l, inv, O_l, 0)
            elif tx < 256:
                T.set_max_nreg(168, 1)
                T.fill(acc_o_r, 0)
                for i_i in T.serial(num_pairs):
                    accumulate_right(S_shared, alpha_shared, buf0, acc_o_r, sS_ready, sS_free, 0, False)
                    accumulate_right(
                        S_shared, alpha_shared, buf1, acc_o_r, sS_ready, sS_free, 1, i_i == num_pairs - 1
                    )
                T.barrier_wait(done, 0)
                write_out(Out, MidO, bid, h0, sid, acc_o_r, inv_shared, O_r, half)
            else:
                T.set_max_nreg(72, 0)
                last = T.max(end - 1, 0)
                slots = T.alloc_local([BLOCK_N // 16], "int64")
                for i_i in T.serial(num_pairs):
                    produce(KV, Table, row, slots, buf0, start + (2 * i_i) * BLOCK_N, end, last, i_i & 1, tx)
                    produce(
                        KV, Table, row, slots, buf1, start + (2 * i_i + 1) * BLOCK_N, end, last, i_i & 1, tx
                    )

    # ---- the "seesaw" schedule (FlashMLA's dense decode, in this kernel's terms) -------------------
    # Tiles go in pairs (A in buffer 0, B in buffer 1). WG0 owns S_A = Q K_A^T and O[:, :256]; WG1 owns
    # S_B and O[:, 256:]. Each WG multiplies its own P (registers, bf16) by its V half and the other
    # WG's P (shared) by the same half of the other tile, so both warpgroups do the same FLOPs and
    # one's softmax runs while the other's GEMMs keep the tensor cores busy. The running max passes
    # WG0 -> WG1 (m after A) and back (m after B). WG0 publishes P_A at its own max right after its
    # softmax, and WG1 multiplies it first (its O half brought to that max), then takes its own max:
    # so A's right half, which WG0's next QK^T needs, is freed half a pair earlier than if WG1 waited
    # for P_A at the later max (+1.5-3.3% at h_q = 128, timed round-robin; PERF.md, fifteenth session).
    # Each KV buffer has a left half (value columns 0-255) and a right half (256-511 and the rope
    # tail), each with its own ready / free barrier, so the left half of A's buffer refills as soon as
    # WG0's own P_A V_A-left is done (half a pair earlier than a whole buffer would). Shared memory: Q
    # without its rope tail (kept in registers per WG, an RS wgmma) makes room for the two P tiles next
    # to two 72 KB KV buffers.

    @T.macro
    def fill_half(
        KV, slots, dst, col0, width, dst2, col2, width2, ready, free, parity, lane_row, lane_col, full, base
    ):
        """Producer: one half of a KV buffer, one or two parts, once its readers freed it. The bulk copies
        carry FlashMLA's evict-first L2 hint (each tile is read by a row's head blocks at about the same
        time, then never again): +0.3-1% at h_q = 128 (+4.5% at 1K), timed round-robin."""
        T.barrier_wait(free[0], parity ^ 1)
        if use_tma and full:  # a whole tile inside one page: bulk copies, swizzled by the TMA unit
            if load:
                T.tma_copy(
                    KV[base : base + BLOCK_N, col0 : col0 + width],
                    dst,
                    barrier=ready[0],
                    eviction_policy="evict_first",
                )
                if width2 > 0:
                    T.tma_copy(
                        KV[base : base + BLOCK_N, col2 : col2 + width2],
                        dst2,
                        barrier=ready[0],
                        eviction_policy="evict_first",
                    )
            T.barrier_arrive(ready[0])
        else:
            gather_copies(KV, slots, dst, col0, width, lane_row, lane_col)
            if width2 > 0:
                gather_copies(KV, slots, dst2, col2, width2, lane_row, lane_col)
            T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def tile_slots(Table, row, slots, tile_start, last, lane_row):
        """The gather's slots of one tile (this thread's rows)."""
        for r in T.unroll(BLOCK_N // 16):
            pos = T.min(tile_start + r * 16 + lane_row, last)  # past the end: the last token again
            slots[r] = T.cast(Table[row, pos // page], "int64") * page + T.cast(pos % page, "int64")

    @T.macro
    def produce_pair(KV, Table, row, slots, bufs, a_start, end, last, parity, tx):
        """Producer, one pair: A's left half (freed first, by WG0 alone), A's right half, B's right
        half, B's left half (freed last, after WG0's P_B V_B-left): the order the halves free up. A
        tile whole inside one page goes by TMA from its first slot (clamped to the row's last token so
        that a padded tile past the end never indexes past the table)."""
        (l0, r0, t0, rdy0_l, rdy0_r, free0_l, free0_r), (l1, r1, t1, rdy1_l, rdy1_r, free1_l, free1_r) = bufs
        p = tx - 256
        lane_row = p // 8
        lane_col = (p % 8) * 8
        b_start = a_start + BLOCK_N
        a_first = T.min(a_start, last)
        b_first = T.min(b_start, last)
        a_base = T.cast(Table[row, a_first // page], "int64") * page + T.cast(a_first % page, "int64")
        b_base = T.cast(Table[row, b_first // page], "int64") * page + T.cast(b_first % page, "int64")
        a_full = a_start + BLOCK_N <= end
        b_full = b_start + BLOCK_N <= end
        if a_start + BLOCK_N > end or not use_tma:  # the tile gathers: slots needed
            tile_slots(Table, row, slots, a_start, last, lane_row)
        fill_half(
            KV, slots, l0, 0, half, l0, 0, 0, rdy0_l, free0_l, parity, lane_row, lane_col, a_full, a_base
        )
        fill_half(
            KV, slots, r0, half, half, t0, d_v, d_pe, rdy0_r, free0_r, parity, lane_row, lane_col, a_full, a_base
        )  # fmt: skip
        if b_start + BLOCK_N > end or not use_tma:
            tile_slots(Table, row, slots, b_start, last, lane_row)
        fill_half(
            KV, slots, r1, half, half, t1, d_v, d_pe, rdy1_r, free1_r, parity, lane_row, lane_col, b_full, b_base
        )  # fmt: skip
        fill_half(
            KV, slots, l1, 0, half, l1, 0, 0, rdy1_l, free1_l, parity, lane_row, lane_col, b_full, b_base
        )

    @T.macro
    def masked_scores(acc_s, tile_start, end):
        # masked scores start at -inf and stay there (wgmma accumulates into acc_s)
        for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
            acc_s[h_i, n_i] = T.if_then_else(tile_start + n_i < end, 0, -T.infinity(accum))

    @T.macro
    def exp_scores(acc_s, m_i, sum_i):
        """P = exp2(S sm_scale - m sm_scale) in place, and its row sums."""
        for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
            acc_s[h_i, n_i] = T.exp2(acc_s[h_i, n_i] * sm_scale - m_i[h_i] * sm_scale)
        T.reduce_sum(acc_s, sum_i, dim=1)

    @T.macro
    def load_q(Q, bid, h0, Q_half, col0, Q_tail_f):
        """One WG's share of Q: half of the value columns into shared (the other WG loads the other
        half) and the rope tail into this WG's registers. Rows past the heads are zero."""
        for h_i, d_i in T.Parallel(BLOCK_H, half):
            Q_half[h_i, d_i] = T.if_then_else(h0 + h_i < num_heads, Q[bid, h0 + h_i, col0 + d_i], 0)
        for h_i, d_i in T.Parallel(BLOCK_H, d_pe):
            Q_tail_f[h_i, d_i] = T.if_then_else(h0 + h_i < num_heads, Q[bid, h0 + h_i, d_v + d_i], 0)

    def consumer_registers():
        """One seesaw consumer's fragments (allocated at trace time, in `attend_seesaw`'s frame)."""
        return (
            T.alloc_fragment([BLOCK_H, d_pe], dtype),
            T.alloc_fragment([BLOCK_H, BLOCK_N], accum),
            T.alloc_fragment([BLOCK_H, BLOCK_N], dtype),
            T.alloc_fragment([BLOCK_H, half], accum),
            *[T.alloc_fragment([BLOCK_H], accum) for _ in range(7)],
        )

    @T.macro
    def attend_seesaw(Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse):
        with T.Kernel(head_blocks, batch, num_splits, threads=384) as (hb, bid, sid):
            Q_l, Q_r, kv0_l, kv0_r, kv1_l, kv1_r, k0_tail, k1_tail = shared_tiles()
            P0_shared = T.alloc_shared([BLOCK_H, BLOCK_N], dtype)  # WG0's P_A, at WG1's max
            P1_shared = T.alloc_shared([BLOCK_H, BLOCK_N], dtype)  # WG1's P_B
            m0_shared = T.alloc_shared([BLOCK_H], accum)  # max after A (WG0 -> WG1)
            scale0_shared = T.alloc_shared([BLOCK_H], accum)  # exp2 of (max before A - max after A)
            m1_shared = T.alloc_shared([BLOCK_H], accum)  # max after B (WG1 -> WG0)
            scale1_shared = T.alloc_shared([BLOCK_H], accum)  # exp2 of (max after A - max after B)
            sum0_shared = T.alloc_shared([BLOCK_H], accum)
            sum1_shared = T.alloc_shared([BLOCK_H], accum)

            # each consumer's registers: Q's rope tail, S, P (bf16), its O half, per-row statistics
            q0_tail, s0, p0, o0, m0, m0_prev, scale0, sum0, sum0_i, inv0, _ = consumer_registers()
            q1_tail, s1, p1, o1, m1, m1_prev, scale1, sum1, sum1_i, inv1, both1 = consumer_registers()

            rdy0_l = T.alloc_barrier(arrive_count=128)  # producer -> consumers
            rdy0_r = T.alloc_barrier(arrive_count=128)
            rdy1_l = T.alloc_barrier(arrive_count=128)
            rdy1_r = T.alloc_barrier(arrive_count=128)
            free0_l = T.alloc_barrier(arrive_count=128)  # WG0 (S_A, P_A V_A-left)
            free0_r = T.alloc_barrier(arrive_count=256)  # WG0 (S_A) and WG1 (P_A V_A-right)
            free1_l = T.alloc_barrier(arrive_count=256)  # WG1 (S_B) and WG0 (P_B V_B-left)
            free1_r = T.alloc_barrier(arrive_count=128)  # WG1 (S_B, P_B V_B-right)
            q_ready = T.alloc_barrier(arrive_count=256)  # both halves of Q are in shared
            sums_ready = T.alloc_barrier(arrive_count=256)  # both row sums; both done with Q
            bufs = (
                (kv0_l, kv0_r, k0_tail, rdy0_l, rdy0_r, free0_l, free0_r),
                (kv1_l, kv1_r, k1_tail, rdy1_l, rdy1_r, free1_l, free1_r),
            )

            row = T.cast(Rows[bid], "int64")
            seq_len = T.cast(SeqLens[bid], "int32")
            per_split = T.ceildiv(T.ceildiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
            start = sid * per_split
            end = T.min(start + per_split, seq_len)
            num_tiles = T.ceildiv(T.max(end - start, 0), BLOCK_N)
            num_pairs = T.ceildiv(num_tiles, 2)  # an odd last tile pairs with a fully masked one
            h0 = hb * BLOCK_H
            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(232, 1)
                load_q(Q, bid, h0, Q_l, 0, q0_tail)
                T.fence_proxy_async()  # plain stores, read by the other WG's wgmma (async proxy)
                T.barrier_arrive(q_ready)
                T.fill(sum0, 0)
                T.fill(m0, -(2**30))  # finite: exp2(m_prev - m_new) must not be inf - inf
                T.fill(o0, 0)
                T.barrier_wait(q_ready, 0)
                for i_i in T.serial(num_pairs):
                    parity = i_i & 1
                    masked_scores(s0, start + 2 * i_i * BLOCK_N, end)
                    T.barrier_wait(rdy0_l[0], parity)
                    T.wgmma_gemm(Q_l, kv0_l, s0, transpose_B=True)
                    T.barrier_wait(rdy0_r[0], parity)
                    T.wgmma_gemm(Q_r, kv0_r, s0, transpose_B=True)
                    T.wgmma_gemm(q0_tail, k0_tail, s0, transpose_B=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free0_r[0])
                    T.copy(m0, m0_prev)
                    T.reduce_max(s0, m0, dim=1, clear=False)
                    for h_i in T.Parallel(BLOCK_H):
                        scale0[h_i] = T.exp2((m0_prev[h_i] - m0[h_i]) * sm_scale)
                    T.copy(m0, m0_shared)
                    T.copy(scale0, scale0_shared)
                    T.named_barrier_arrive(M0_READY, 256)
                    exp_scores(s0, m0, sum0_i)
                    for h_i in T.Parallel(BLOCK_H):
                        sum0[h_i] = sum0[h_i] * scale0[h_i] + sum0_i[h_i]
                    # P_A at the max after A, published at once: WG1 brings its O half to that max
                    # and multiplies P_A first, which frees A's right half for the next pair early
                    T.copy(s0, P0_shared)
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P0_READY, 256)
                    for h_i, d_i in T.Parallel(BLOCK_H, half):
                        o0[h_i, d_i] *= scale0[h_i]
                    T.copy(s0, p0)
                    T.wgmma_gemm(p0, kv0_l, o0)
                    T.sync_threads(M1_READY, 256)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free0_l[0])
                    for h_i in T.Parallel(BLOCK_H):
                        sum0[h_i] *= scale1_shared[h_i]
                        m0[h_i] = m1_shared[h_i]
                    for h_i, d_i in T.Parallel(BLOCK_H, half):
                        o0[h_i, d_i] *= scale1_shared[h_i]
                    T.sync_threads(P1_READY, 256)
                    T.wgmma_gemm(P1_shared, kv1_l, o0)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free1_l[0])
                T.copy(sum0, sum0_shared)
                T.barrier_arrive(sums_ready)
                T.barrier_wait(sums_ready, 0)
                # an empty split (row shorter than the split start) has sum 0: output 0, LSE -inf
                for h_i in T.Parallel(BLOCK_H):
                    sum0[h_i] += sum1_shared[h_i]  # the row sums over both tiles of every pair
                    inv0[h_i] = T.if_then_else(sum0[h_i] > 0, 1.0 / sum0[h_i], 0)
                write_lse(Lse, MidLse, bid, h0, sid, sum0, m0)
                write_out(Out, MidO, bid, h0, sid, o0, inv0, Q_l, 0)
            elif tx < 256:
                T.set_max_nreg(232, 1)
                load_q(Q, bid, h0, Q_r, half, q1_tail)
                T.fence_proxy_async()
                T.barrier_arrive(q_ready)
                T.fill(sum1, 0)
                T.fill(o1, 0)
                T.barrier_wait(q_ready, 0)
                for i_i in T.serial(num_pairs):
                    parity = i_i & 1
                    masked_scores(s1, start + (2 * i_i + 1) * BLOCK_N, end)
                    T.barrier_wait(rdy1_r[0], parity)
                    T.wgmma_gemm(Q_r, kv1_r, s1, transpose_B=True)
                    T.wgmma_gemm(q1_tail, k1_tail, s1, transpose_B=True)
                    T.barrier_wait(rdy1_l[0], parity)
                    T.wgmma_gemm(Q_l, kv1_l, s1, transpose_B=True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free1_l[0])
                    T.sync_threads(M0_READY, 256)
                    for h_i in T.Parallel(BLOCK_H):
                        m1_prev[h_i] = m0_shared[h_i]
                        m1[h_i] = m0_shared[h_i]
                    # O half to the max after A, then P_A V_A-right (under this WG's max and scales),
                    # which frees A's right half half a pair before this WG's own PV
                    for h_i, d_i in T.Parallel(BLOCK_H, half):
                        o1[h_i, d_i] *= scale0_shared[h_i]
                    T.sync_threads(P0_READY, 256)
                    T.wgmma_gemm(P0_shared, kv0_r, o1)
                    T.reduce_max(s1, m1, dim=1, clear=False)
                    for h_i in T.Parallel(BLOCK_H):
                        scale1[h_i] = T.exp2((m1_prev[h_i] - m1[h_i]) * sm_scale)
                        both1[h_i] = scale0_shared[h_i] * scale1[h_i]
                    # P_A V_A-right done: A's right half is released. P0_shared needs no wait here (WG0
                    # rewrites it only after A's next right half, which this release gates, has landed);
                    # handing M1 over before the wait was 1-2.5% slower (PERF.md, sixteenth session)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free0_r[0])
                    T.copy(m1, m1_shared)
                    T.copy(scale1, scale1_shared)
                    T.named_barrier_arrive(M1_READY, 256)
                    exp_scores(s1, m1, sum1_i)
                    for h_i in T.Parallel(BLOCK_H):
                        sum1[h_i] = sum1[h_i] * both1[h_i] + sum1_i[h_i]
                    for h_i, d_i in T.Parallel(BLOCK_H, half):
                        o1[h_i, d_i] *= scale1[h_i]
                    T.copy(s1, p1)
                    T.copy(s1, P1_shared)
                    T.fence_proxy_async()
                    T.named_barrier_arrive(P1_READY, 256)
                    T.wgmma_gemm(p1, kv1_r, o1)
                    T.wait_wgmma(0)
                    T.barrier_arrive(free1_r[0])
                T.copy(sum1, sum1_shared)
                T.barrier_arrive(sums_ready)
                T.barrier_wait(sums_ready, 0)
                for h_i in T.Parallel(BLOCK_H):
                    total = sum1[h_i] + sum0_shared[h_i]
                    inv1[h_i] = T.if_then_else(total > 0, 1.0 / total, 0)
                write_out(Out, MidO, bid, h0, sid, o1, inv1, Q_r, half)
            else:
                T.set_max_nreg(40, 0)
                last = T.max(end - 1, 0)
                slots = T.alloc_local([BLOCK_N // 16], "int64")
                for i_i in T.serial(num_pairs):
                    produce_pair(
                        KV, Table, row, slots, bufs, start + 2 * i_i * BLOCK_N, end, last, i_i & 1, tx
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
            if seesaw:
                attend_seesaw(Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse)
            else:
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
            if seesaw:
                attend_seesaw(Q, KV, Table, Rows, SeqLens, Out, Lse, None, None)
            else:
                attend(Q, KV, Table, Rows, SeqLens, Out, Lse, None, None)

        func = mla_decode_direct

    # no_load never writes the KV buffers, which TileLang's read-before-write check rejects
    configs = PASS_CONFIGS if load else {**PASS_CONFIGS, "tl.disable_buffer_init_check": True}
    return tilelang.compile(func, target="cuda", pass_configs=configs)


PASS_CONFIGS = {"tl.enable_fast_math": True}


def mla_decode_paged(
    q: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    page: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton.mla_decode_paged` (the launcher both entry points share) on this kernel; what `supported`
    does not cover runs the Triton one."""
    batch, num_heads, dim = q.shape
    d_pe = dim - kv_lora_rank
    if not supported(q, kv_lora_rank) or pool.dtype != q.dtype:
        # e.g. float32 tests, or an e4m3 pool (--kv-cache-dtype fp8_e4m3): the Triton kernel upcasts
        from runtime.gpu.kernels.mla_decode import triton

        return triton.mla_decode_paged(
            q, pool, table, rows, seq_lens, scale, kv_lora_rank, page, num_splits, out, lse
        )  # fmt: skip
    assert pool.shape[-1] == dim and pool.dtype == q.dtype, (q.shape, pool.shape, pool.dtype)
    assert pool.is_contiguous(), "the latent pool is indexed densely (a [slots, D] view)"
    q, table = q.contiguous(), table.contiguous()  # no-ops for the engine's tensors
    out = q.new_empty(batch, num_heads, kv_lora_rank) if out is None else out
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.is_contiguous() and lse.is_contiguous()
    if batch == 0:
        return out, lse
    head_blocks = -(-num_heads // BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, table.shape[1] * page, q.device)
    split = num_splits > 1
    kernel = _kernel(
        num_heads, kv_lora_rank, d_pe, _TL_DTYPE[q.dtype], _TL_DTYPE[table.dtype], _TL_DTYPE[rows.dtype],
        _TL_DTYPE[seq_lens.dtype], page, split, float(scale * LOG2E), schedule(DEFAULT_OPTS, page),
    )  # fmt: skip
    if split:
        mid_o = torch.empty(batch, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        kernel(q, pool, table, rows, seq_lens, mid_o, mid_lse, out, lse)
    else:
        kernel(q, pool, table, rows, seq_lens, out, lse)
    return out, lse


def mla_decode(
    q, latent_pool, req_to_token, rows, seq_lens, scale, kv_lora_rank=512, num_splits=None, out=None,
    return_lse=False, page_size=1,
):  # fmt: skip
    """`MlaDecode`: with a page table of pages of a multiple of 64 tokens, whole tiles arrive by TMA and
    the seesaw schedule runs (`schedule`)."""
    o, lse = mla_decode_paged(
        q, pool_2d(latent_pool), req_to_token, rows, seq_lens, scale, kv_lora_rank, page_size, num_splits, out
    )
    return (o, lse) if return_lse else o

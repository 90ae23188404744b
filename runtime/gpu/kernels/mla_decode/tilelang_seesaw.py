"""The seesaw schedule of the TileLang MLA decode kernel (`tilelang_kernel.py`), for tables whose pages
hold whole 64-token tiles (a FlashMLA block table): FlashMLA's dense decode, in this kernel's terms,
whole tiles copied by TMA.

Tiles go in pairs (A in buffer 0, B in buffer 1). WG0 owns S_A = Q K_A^T and O[:, :256]; WG1 owns
S_B and O[:, 256:]. Each WG multiplies its own P (registers, bf16) by its V half and the other
WG's P (shared) by the same half of the other tile, so both warpgroups do the same FLOPs and
one's softmax runs while the other's GEMMs keep the tensor cores busy. The running max passes
WG0 -> WG1 (m after A) and back (m after B). WG0 publishes P_A at its own max right after its
softmax, and WG1 multiplies it first (its O half brought to that max), then takes its own max:
so A's right half, which WG0's next QK^T needs, is freed half a pair earlier than if WG1 waited
for P_A at the later max (+1.5-3.3% at h_q = 128 on the H200, timed round-robin).
Each KV buffer has a left half (value columns 0-255) and a right half (256-511 and the rope
tail), each with its own ready / free barrier, so the left half of A's buffer refills as soon as
WG0's own P_A V_A-left is done (half a pair earlier than a whole buffer would). Shared memory: Q
without its rope tail (kept in registers per WG, an RS wgmma) makes room for the two P tiles next
to two 72 KB KV buffers.

The hand-offs between WG0 and WG1 are named barriers (see M0_READY) and the KV copies carry an
evict-first hint. Timed and removed: per-64-column ready barriers, issuing the next pair's QK^T ahead of
the last PV and reordering the producer (4% slower, equal, equal), and the variants listed in
docs/PERF.md (TMA multicast in a 2-CTA cluster among them, and FlashMLA's own issue order: each
warpgroup's next S queued behind its last PV, with per-part barriers and consumer-issued copies, 9-10%
slower; WG1's S_B moved behind its P_A V_A-right, so that B's refill has slack, 6-8% slower: the math
alone lost 3-4%). Measured on the H200 at h_q = 128: the math alone (no loads) runs at 624-650
TFLOP/s, with the loads 515-537: the two 72 KB KV buffers (all that fits beside Q) leave one tile pair
of prefetch, and each half is refilled only after its last reader of the pair, so the next pair waits
for part of the copy's latency (a clock64 timeline of the waits is in PERF.md). That is the remaining
gap to FlashMLA: with every tile in L2 the same kernel reads 586 TFLOP/s at 4K, 101% of FlashMLA's
figure; L2 prefetch half a pair ahead did not recover it."""

from runtime.gpu.kernels.mla_decode.tilelang_tiles import BLOCK_H, BLOCK_N

# The four per-pair hand-offs between the consumer warpgroups are hardware named barriers (bar.arrive by
# the writer, bar.sync by the reader, 256 threads), as in FlashMLA: 1.5-3% faster at h_q = 128 than
# mbarriers (H200, timed round-robin; PERF.md). They need no phase: a writer cannot arrive for pair i + 1
# before the reader's sync of pair i, since each warpgroup waits for the other once per pair in between.
# TileLang's own syncs in this kernel use ids 0, 3 and 4.
M0_READY, M1_READY, P0_READY, P1_READY = 8, 9, 10, 11


def attend(
    *, num_heads, d_v, d_pe, half, head_blocks, dtype, accum, page, sm_scale, batch, num_splits, write_lse,
    write_out, shared_tiles, key_end,
):  # fmt: skip
    """The schedule's kernel body, a macro of (Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse), built
    for `tilelang_kernel.kernel`'s sizes, dtypes, dynamic extents and shared macros."""
    import tilelang.language as T

    @T.macro
    def gather_copies(KV, slots, dst, col0, width, lane_row, lane_col):
        """cp.async 16 B per thread and row (8 threads per token row, 16 rows per pass)."""
        for r in T.unroll(BLOCK_N // 16):
            for u in T.unroll(-(-width // 64)):
                if width % 64 == 0 or 64 * u + lane_col < width:
                    T.ptx_cp_async(
                        T.access_ptr(dst[r * 16 + lane_row, 64 * u + lane_col], "w", 8),
                        T.access_ptr(KV[slots[r], col0 + 64 * u + lane_col], "r", 8),
                        8,
                    )

    @T.macro
    def fill_half(
        KV, slots, dst, col0, width, dst2, col2, width2, ready, free, parity, lane_row, lane_col, full, base
    ):
        """Producer: one half of a KV buffer, one or two parts, once its readers freed it. The bulk copies
        carry FlashMLA's evict-first L2 hint (each tile is read by a row's head blocks at about the same
        time, then never again): +0.3-1% at h_q = 128 (+4.5% at 1K), timed round-robin."""
        T.barrier_wait(free[0], parity ^ 1)
        if full:  # a whole tile inside one page: bulk copies, swizzled by the TMA unit
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
        if a_start + BLOCK_N > end:  # the tile gathers: slots needed
            tile_slots(Table, row, slots, a_start, last, lane_row)
        fill_half(
            KV, slots, l0, 0, half, l0, 0, 0, rdy0_l, free0_l, parity, lane_row, lane_col, a_full, a_base
        )
        fill_half(
            KV, slots, r0, half, half, t0, d_v, d_pe, rdy0_r, free0_r, parity, lane_row, lane_col, a_full, a_base
        )  # fmt: skip
        if b_start + BLOCK_N > end:
            tile_slots(Table, row, slots, b_start, last, lane_row)
        fill_half(
            KV, slots, r1, half, half, t1, d_v, d_pe, rdy1_r, free1_r, parity, lane_row, lane_col, b_full, b_base
        )  # fmt: skip
        fill_half(
            KV, slots, l1, 0, half, l1, 0, 0, rdy1_l, free1_l, parity, lane_row, lane_col, b_full, b_base
        )

    @T.macro
    def masked_scores(acc_s, tile_start, end, seq_len, h0):
        # masked scores start at -inf and stay there (wgmma accumulates into acc_s)
        for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
            acc_s[h_i, n_i] = T.if_then_else(
                tile_start + n_i < key_end(end, seq_len, h0 + h_i), 0, -T.infinity(accum)
            )

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
                    masked_scores(s0, start + 2 * i_i * BLOCK_N, end, seq_len, h0)
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
                    masked_scores(s1, start + (2 * i_i + 1) * BLOCK_N, end, seq_len, h0)
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
                    # handing M1 over before the wait was 1-2.5% slower (H200, round-robin)
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

    return attend_seesaw

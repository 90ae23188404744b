"""The three-role schedule of the TileLang MLA decode kernel (`tilelang_kernel.py`), for tables whose
pages do not hold whole 64-token tiles (the engine's per-token req_to_token): the FlashMLA / TileLang
`example_mla_decode_ws` division of labour, every tile gathered.

- WG2, the producer: walks the split 64 tokens at a time and gathers each token's 576-wide latent
  row into one of two shared KV buffers with cp.async (8 threads per row, 16 B each). The slot of token
  `pos` is `table[row, pos // PAGE] * PAGE + pos % PAGE` (PAGE = 1: the per-token table), so slots need
  no alignment. The buffer's "ready" mbarrier fires when the copies land
  (cp.async.mbarrier.arrive.noinc); its "free" mbarrier, when both consumers are done.
- WG0: S = Q K^T for the tile (wgmma 64 x 64 x 576, Q resident in shared memory), online softmax in
  float32 base 2 (scores past the end start at -inf), then P (bf16) and the per-head rescale factor go
  to shared memory and WG0 does O[:, :256] += P V[:, :256].
- WG1: waits for P, rescales and does O[:, 256:] += P V[:, 256:].

setmaxnreg moves registers from the producer to the consumers (240 / 168 / 72)."""

from runtime.gpu.kernels.mla_decode.tilelang_tiles import BLOCK_H, BLOCK_N


def attend(
    *, num_heads, d_v, d_pe, half, head_blocks, dtype, accum, page, sm_scale, batch, num_splits, write_lse,
    write_out, shared_tiles, key_end,
):  # fmt: skip
    """The schedule's kernel body, a macro of (Q, KV, Table, Rows, SeqLens, Out, Lse, MidO, MidLse), built
    for `tilelang_kernel.kernel`'s sizes, dtypes, dynamic extents and shared macros."""
    import tilelang.language as T

    @T.macro
    def gather_all(KV, slots, kv_l, kv_r, k_tail, ready, lane_row, lane_col):
        for r in T.unroll(BLOCK_N // 16):
            t_row = r * 16 + lane_row
            for u in T.unroll(half // 64):  # 16 B per cp.async, no bounds check (slots are the caller's)
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
                T.ptx_cp_async(
                    T.access_ptr(k_tail[t_row, lane_col], "w", 8),
                    T.access_ptr(KV[slots[r], d_v + lane_col], "r", 8),
                    8,
                )
        T.cp_async_barrier_noinc(ready[0])

    @T.macro
    def produce(KV, Table, row, slots, buf, tile_start, last, parity, tx):
        """Producer warpgroup: one tile into one KV buffer, by the gather."""
        kv_l, kv_r, k_tail, ready, free = buf
        p = tx - 256
        lane_row = p // 8
        lane_col = (p % 8) * 8
        # Look the slots up before waiting for the buffer, so the table reads' latency hides under the
        # wait (the wait is a memory barrier the compiler will not hoist the loads across).
        for r in T.unroll(BLOCK_N // 16):
            pos = T.min(tile_start + r * 16 + lane_row, last)  # past the end: the last token again
            slots[r] = T.cast(Table[row, pos // page], "int64") * page + T.cast(pos % page, "int64")
        T.barrier_wait(free[0], parity ^ 1)  # both consumers are done with this buffer
        gather_all(KV, slots, kv_l, kv_r, k_tail, ready, lane_row, lane_col)

    @T.macro
    def score_tile(
        Q_l, Q_r, Q_tail, buf, acc_s, acc_o_l, m_i, m_prev, alpha, sumexp, sumexp_i, parity, tile_start, end,
        seq_len, h0,
    ):  # fmt: skip
        """WG0, one tile: S = Q K^T, online softmax, O_left rescaled."""
        kv_l, kv_r, k_tail, ready, free = buf
        # masked scores start at -inf and stay there (wgmma accumulates into acc_s)
        for h_i, n_i in T.Parallel(BLOCK_H, BLOCK_N):
            acc_s[h_i, n_i] = T.if_then_else(
                tile_start + n_i < key_end(end, seq_len, h0 + h_i), 0, -T.infinity(accum)
            )
        T.barrier_wait(ready[0], parity)
        T.wgmma_gemm(Q_tail, k_tail, acc_s, transpose_B=True)
        T.wgmma_gemm(Q_l, kv_l, acc_s, transpose_B=True)
        T.wgmma_gemm(Q_r, kv_r, acc_s, transpose_B=True)
        T.wait_wgmma(0)
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
        kv_l, kv_r, k_tail, ready, free = buf
        T.copy(alpha, alpha_shared)
        T.copy(acc_s, S_shared)
        T.gemm(S_shared, kv_l, acc_o_l)
        T.barrier_arrive(sS_ready)
        T.barrier_arrive(free[0])

    @T.macro
    def accumulate_right(S_shared, alpha_shared, buf, acc_o_r, sS_ready, sS_free, parity, last_tile):
        """WG1, one tile: wait for P, rescale O_right, O_right += P V_right."""
        kv_l, kv_r, k_tail, ready, free = buf
        T.barrier_arrive(sS_ready)
        T.barrier_wait(sS_ready, parity)
        for h_i, d_i in T.Parallel(BLOCK_H, half):
            acc_o_r[h_i, d_i] *= alpha_shared[h_i]
        T.gemm(S_shared, kv_r, acc_o_r)
        T.barrier_arrive(free[0])
        if not last_tile:
            T.barrier_arrive(sS_free)

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

            # per buffer, producer -> consumers "ready" and consumers -> producer "free" (one barrier
            # each for all three parts of the buffer)
            ready0 = T.alloc_barrier(arrive_count=128)
            ready1 = T.alloc_barrier(arrive_count=128)
            free0 = T.alloc_barrier(arrive_count=256)  # WG0 and WG1 after their PV halves
            free1 = T.alloc_barrier(arrive_count=256)
            buf0 = (kv0_l, kv0_r, k0_tail, ready0, free0)
            buf1 = (kv1_l, kv1_r, k1_tail, ready1, free1)
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
                        i_i & 1, start + (2 * i_i) * BLOCK_N, end, seq_len, h0,
                    )  # fmt: skip
                    if i_i != 0:  # WG1 has finished reading the previous P
                        T.barrier_arrive(sS_free)
                        T.barrier_wait(sS_free, 1)
                    publish_and_accumulate(acc_s, S_shared, alpha, alpha_shared, buf0, acc_o_l, sS_ready)
                    # tile 2 i_i + 1 in buffer 1
                    score_tile(
                        Q_l, Q_r, Q_tail, buf1, acc_s, acc_o_l, m_i, m_prev, alpha, sumexp, sumexp_i,
                        i_i & 1, start + (2 * i_i + 1) * BLOCK_N, end, seq_len, h0,
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
                    produce(KV, Table, row, slots, buf0, start + (2 * i_i) * BLOCK_N, last, i_i & 1, tx)
                    produce(KV, Table, row, slots, buf1, start + (2 * i_i + 1) * BLOCK_N, last, i_i & 1, tx)

    return attend

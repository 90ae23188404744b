"""`pool_closing` in one Triton launch: a program per (group, window it may close), all channels at once.

The program works out its window from the group's first position (the i-th position at or past it
that ends a window), whether the group's run reaches it, and its entry row from the page table: the
index math of `reference.closing_windows`, a few integer ops here instead of about 26 tensor ops a rate
and step. The window's raw tokens are read where they are (this step's projection row or the row's tail slot: a
pointer per token), SLOTS tokens at a time with an online softmax per channel, so HCA's 128-token
windows need no [128, d] tile. The pooled row (rounded to kv's dtype, as the reference's sum is) is
RMS-normed and roped in registers and stored only if the window closes: nothing else is written."""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.gpu.kernels.common import next_pow2
from runtime.gpu.kernels.rope.triton import rotate_pairs

SLOTS = 16  # raw tokens a loop step: [16, 512] float32 tiles of kv and gate in 4 warps


@triton.jit
def _pool_closing(
    KV, Gate, TailKV, TailGate, Rows, Positions, InRun, Table, Entries, Bias, NormW, InvFreq,
    n_windows, q_len, num_places, eps, scaling,
    stride_kv, stride_gate, stride_tkr, stride_tks, stride_tgr, stride_tgs, stride_table, stride_e, stride_b,
    RATE: tl.constexpr, SPAN: tl.constexpr, D: tl.constexpr, ROPE_HALF: tl.constexpr, OVERLAP: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b, i = pid // n_windows, pid % n_windows
    first = tl.load(Positions + b * q_len).to(tl.int64)
    last = first + (RATE - 1 - first % RATE) + RATE * i  # positions are >= 0: C-style % is the floor's
    offset = last - first  # the window's last place in the group
    in_run = tl.load(InRun + b * q_len + tl.minimum(offset, q_len - 1)) != 0
    if (offset < q_len) & in_run:
        row = tl.load(Rows + b * q_len).to(tl.int64)
        win = last // RATE
        offs_d = tl.arange(0, D)
        run_max = tl.full([D], float("-inf"), tl.float32)
        run_sum = tl.zeros([D], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, SPAN, SLOTS):
            offs_s = s0 + tl.arange(0, SLOTS)
            real = offs_s < SPAN
            raw = last - (SPAN - 1) + offs_s  # the token's position (negative: before the sequence)
            slot = ((raw % SPAN) + SPAN) % SPAN
            new = raw >= first
            place = tl.minimum(tl.maximum(b * q_len + raw - first, 0), num_places - 1)
            if OVERLAP:  # the first RATE tokens (the window before) give Ca [0, d), the rest Cb [d, 2d)
                half = offs_s >= RATE
                col = tl.where(half, D, 0)[:, None] + offs_d[None, :]
                bias_row = tl.where(half, offs_s - RATE, offs_s)
                keep = real & (half | (offs_s * 0 + win >= 1))  # window 0 has no window before it
            else:
                col = offs_d[None, :] + tl.zeros([SLOTS, 1], tl.int32)
                bias_row = offs_s
                keep = real
            kv_ptr = tl.where(new[:, None], KV + place[:, None] * stride_kv, TailKV + row * stride_tkr
                              + slot[:, None] * stride_tks) + col  # fmt: skip
            gate_ptr = tl.where(new[:, None], Gate + place[:, None] * stride_gate, TailGate + row * stride_tgr
                                + slot[:, None] * stride_tgs) + col  # fmt: skip
            kv = tl.load(kv_ptr, mask=keep[:, None], other=0.0).to(tl.float32)
            g = tl.load(gate_ptr, mask=keep[:, None], other=0.0).to(tl.float32)
            g += tl.load(Bias + bias_row[:, None] * stride_b + col, mask=keep[:, None], other=0.0)
            g = tl.where(keep[:, None], g, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(g, 0))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # a channel with no token yet
            p = tl.exp(g - safe[None, :])
            alpha = tl.exp(run_max - safe)
            run_sum = run_sum * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p * kv, 0)
            run_max = new_max
        dtype = KV.dtype.element_ty  # the reference's sum, norm and rope each round to it
        pooled = (acc / run_sum).to(dtype).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(pooled * pooled, 0) / D + eps)
        w = tl.load(NormW + offs_d).to(tl.float32)
        y = (w * (pooled * inv).to(dtype).to(tl.float32)).to(dtype)
        # rope on the trailing 2 ROPE_HALF channels, at the window's first position
        row_y = tl.reshape(y.to(tl.float32), (1, D))
        out = rotate_pairs(row_y, win * RATE, InvFreq, D // 2 - ROPE_HALF, ROPE_HALF, scaling, 1.0, 1, D // 2)
        out = tl.reshape(out, (D,))
        dst = tl.load(Table + row * stride_table + win * RATE).to(tl.int64) // RATE
        tl.store(Entries + dst * stride_e + offs_d, out.to(Entries.dtype.element_ty))


def pool_closing(
    kv, gate, tail_kv, tail_gate, rows, positions, in_run, table, entries, bias, overlap, norm_weight, eps,
    inv_freq, scaling,
) -> None:  # fmt: skip
    """`PoolClosing`: one program per (group, window it may close)."""
    d = entries.shape[1]
    rate = bias.shape[0]
    span = 2 * rate if overlap else rate
    q_len = in_run.shape[1]
    assert d == next_pow2(d) and kv.stride(1) == 1 and gate.stride(1) == 1 and entries.stride(1) == 1
    assert (
        tail_kv.stride(2) == 1 and tail_gate.stride(2) == 1 and bias.is_contiguous() and table.stride(1) == 1
    )
    assert tail_kv.shape[1] == span and kv.shape[1] == (2 * d if overlap else d)
    rows, positions, in_run = (t.contiguous() for t in (rows, positions, in_run))
    n = -(-q_len // rate)
    groups = in_run.shape[0]
    if groups:
        _pool_closing[(groups * n,)](
            kv, gate, tail_kv, tail_gate, rows, positions, in_run, table, entries, bias, norm_weight, inv_freq,
            n, q_len, positions.shape[0], float(eps), float(scaling),
            kv.stride(0), gate.stride(0), tail_kv.stride(0), tail_kv.stride(1), tail_gate.stride(0),
            tail_gate.stride(1), table.stride(0), entries.stride(0), bias.stride(0),
            RATE=rate, SPAN=span, D=d, ROPE_HALF=inv_freq.numel(), OVERLAP=overlap,
            SLOTS=min(SLOTS, next_pow2(span)), num_warps=4,
        )  # fmt: skip

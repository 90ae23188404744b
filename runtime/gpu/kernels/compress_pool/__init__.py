"""DeepSeek-V4's compressors at decode and verify steps: the windows a step closes pooled into entries.

A window of `rate` tokens becomes one entry: per channel, a softmax over its tokens of `gate + bias`
weights their `kv`; the sum is RMS-normed and roped at the window's first position (models/deepseek_v4/
compressor.py says what the entries are for). CSA overlaps windows: an entry pools the Ca half of the
window before and the Cb half of its own, so it reads 2 * rate raw tokens.

- `pool_closing`: every closing window of a step in one launch, its raw tokens read where they are (the
  row's tail of earlier tokens, or this step's projections) and its entry written into the pool. The
  PyTorch form took about 28 ops a call (gathers, the overlap's slot tensors, softmax, sum, norm, rope,
  the masked write), three calls a CSA layer pair; models/deepseek_v4/attention_decode.py.

Triton on CUDA, then the reference."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class PoolClosing(Protocol):
    def __call__(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        tail_kv: torch.Tensor,
        tail_gate: torch.Tensor,
        group_rows: torch.Tensor,
        closes: torch.Tensor,
        window: torch.Tensor,
        dst: torch.Tensor,
        slots: torch.Tensor,
        new: torch.Tensor,
        place: torch.Tensor,
        entries: torch.Tensor,
        bias: torch.Tensor,
        overlap: bool,
        norm_weight: torch.Tensor,
        eps: float,
        inv_freq: torch.Tensor,
        scaling: float,
    ) -> None:
        """B groups, each with n windows it may close: closes [B, n] bool, window [B, n] int (its index),
        dst [B, n] int (its row of `entries`); where each window's `span` raw tokens are, oldest first
        ([B, n, span]): slots (the row's tail slot), new (True: this step's token) and place (its row of
        kv / gate). kv, gate [T, width] are this step's projections, tail_kv / tail_gate [R, span, width]
        the rows' tails (group b's row: group_rows[b]); bias [rate, width] float32 (rate = span, or
        span / 2 with `overlap`, where width = 2 d and the first `rate` tokens give their Ca half
        [0, d), the rest their Cb half, window 0 having no Ca tokens). Each closing window's entry [d]
        (the `reference.pool` math: norm_weight / eps its RMSNorm, inv_freq / scaling the interleaved
        rope on the trailing 2 len(inv_freq) channels at position window * rate) is written to
        entries[dst], in entries' dtype. The dst of a window not closing is any row of `entries` whose
        value stays as it was (the reference writes it back). No device sync."""
        ...


POOL_CLOSING = Op("pool_closing", PoolClosing)
POOL_CLOSING.register("triton", "runtime.gpu.kernels.compress_pool.triton:pool_closing", triton_on_cuda)
POOL_CLOSING.register("reference", "runtime.gpu.kernels.compress_pool.reference:pool_closing", always)

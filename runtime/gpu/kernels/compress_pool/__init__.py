"""DeepSeek-V4's compressors at decode and verify steps: the windows a step closes pooled into entries.

A window of `rate` tokens becomes one entry: per channel, a softmax over its tokens of `gate + bias`
weights their `kv`; the sum is RMS-normed and roped at the window's first position (models/deepseek_v4/
compressor.py says what the entries are for). CSA overlaps windows: an entry pools the Ca half of the
window before and the Cb half of its own, so it reads 2 * rate raw tokens.

- `pool_closing`: every closing window of a step in one launch, which windows close and where their
  raw tokens are worked out in the launch from the places' rows and positions, the tokens read where
  they are (the row's tail of earlier tokens, or this step's projections) and the entry written into
  the pool. The PyTorch form took about 28 ops a call (gathers, the overlap's slot tensors, softmax,
  sum, norm, rope, the masked write) and the windows' index tensors about 26 a rate and step
  (`reference.closing_windows`); models/deepseek_v4/attention_decode.py.

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
        rows: torch.Tensor,
        positions: torch.Tensor,
        in_run: torch.Tensor,
        table: torch.Tensor,
        entries: torch.Tensor,
        bias: torch.Tensor,
        overlap: bool,
        norm_weight: torch.Tensor,
        eps: float,
        inv_freq: torch.Tensor,
        scaling: float,
    ) -> None:
        """A step of B groups of q_len places (T = B q_len; rows, positions [T]: each place's state row
        and position; in_run [B, q_len] bool: place j continues the group's place 0, same row, one
        position on, so a group's run is its first places). kv, gate [T, width] are this step's
        projections, tail_kv / tail_gate [R, span, width] the rows' tails of earlier raw tokens (slot:
        position % span); bias [rate, width] float32 (rate = span, or span / 2 with `overlap`, where
        width = 2 d and a window's entry pools the Ca half [0, d) of the window before and the Cb half
        of its own, window 0 having no Ca tokens). Every window a group's run closes (its last
        position, a multiple of rate less one, is a place of the run; ceil(q_len / rate) candidates a
        group) is pooled from its span raw tokens, oldest first, each read from this step's row if at
        or past the group's first position, else from the row's tail: the `reference.pool` math,
        norm_weight / eps its RMSNorm, inv_freq / scaling the interleaved rope on the trailing
        2 len(inv_freq) channels at position window * rate. Its entry [d] goes to
        entries[table[row, window * rate] // rate] (table: req_to_token, one entry-pool row per rate
        tokens), in entries' dtype; nothing else is written. No device sync."""
        ...


POOL_CLOSING = Op("pool_closing", PoolClosing)
POOL_CLOSING.register("triton", "runtime.gpu.kernels.compress_pool.triton:pool_closing", triton_on_cuda)
POOL_CLOSING.register("reference", "runtime.gpu.kernels.compress_pool.reference:pool_closing", always)

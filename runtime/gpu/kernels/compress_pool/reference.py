"""The compressors' pooling in PyTorch: `pool`, the math of whole windows (prefill calls it through
`Compressor.pool` with the model's norm and rope ops), and `pool_closing`, the op's reference."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from runtime.gpu.kernels.rms_norm.reference import rms_norm
from runtime.gpu.kernels.rope.reference import rope_interleaved


def pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    first_window: int | torch.Tensor,
    bias: torch.Tensor,
    overlap: bool,
    norm: Callable[[torch.Tensor], torch.Tensor],
    rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Raw kv/gate of whole windows first_window.. [..., n * rate, width] -> entries [..., n, d] (leading
    dims: independent sequences, with `first_window` a tensor of their shape; rate = bias.shape[0]).
    With overlap (width 2 d), entry w pools the Ca half of window w - 1 and the Cb half of window w; the
    first window pools its Cb half alone (callers that have its predecessor pass it first and drop that
    entry). `norm` [N, d] -> [N, d] and `rope` (x [N, d], positions [N]) -> x apply to the pooled rows,
    roped at each window's first position."""
    m, lead = bias.shape[0], kv.shape[:-2]
    d = kv.shape[-1] // 2 if overlap else kv.shape[-1]
    n = kv.shape[-2] // m
    kv = kv.view(*lead, n, m, -1)
    gate = gate.view(*lead, n, m, -1) + bias
    if overlap:
        slots_kv = kv.new_zeros(*lead, n, 2 * m, d)
        slots_gate = gate.new_full((*lead, n, 2 * m, d), float("-inf"))
        slots_kv[..., m:, :], slots_gate[..., m:, :] = kv[..., d:], gate[..., d:]
        slots_kv[..., 1:, :m, :], slots_gate[..., 1:, :m, :] = kv[..., :-1, :, :d], gate[..., :-1, :, :d]
        kv, gate = slots_kv, slots_gate
    pooled = (kv * gate.softmax(dim=-2, dtype=torch.float32).to(kv.dtype)).sum(-2)
    first = torch.as_tensor(first_window, device=kv.device).unsqueeze(-1)
    positions = (first + torch.arange(n, device=kv.device)) * m
    return rope(norm(pooled).reshape(-1, d), positions.reshape(-1)).view(*lead, n, d)


def pool_closing(
    kv, gate, tail_kv, tail_gate, group_rows, closes, window, dst, slots, new, place, entries, bias, overlap,
    norm_weight, eps, inv_freq, scaling,
) -> None:  # fmt: skip
    """`PoolClosing`: each window's raw tokens gathered ([B * n, span, width]) and pooled as the last of
    the two windows they span (with overlap) or as one window."""
    rows = group_rows[:, None, None]
    raw_kv = torch.where(new[..., None], kv[place], tail_kv[rows, slots]).flatten(0, 1)
    raw_gate = torch.where(new[..., None], gate[place], tail_gate[rows, slots]).flatten(0, 1)
    win = window.flatten()
    m = bias.shape[0]
    if overlap:
        raw_gate = raw_gate.clone()
        raw_gate[:, :m].masked_fill_((win < 1)[:, None, None], float("-inf"))  # window 0: no Ca tokens
    windows = raw_kv.shape[1] // m
    norm = partial(rms_norm, weight=norm_weight, eps=eps)
    rope = partial(rope_interleaved, inv_freq=inv_freq, scaling=scaling)
    entry = pool(raw_kv, raw_gate, win - (windows - 1), bias, overlap, norm, rope)[:, -1]
    at, shut = dst.flatten(), closes.flatten()[:, None]
    entries[at] = torch.where(shut, entry.to(entries.dtype), entries[at])  # the others keep their rows

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


def closing_windows(
    rows: torch.Tensor,
    positions: torch.Tensor,
    in_run: torch.Tensor,
    table: torch.Tensor,
    rate: int,
    span: int,
) -> tuple[torch.Tensor, ...]:
    """The windows each group's run may close, n = ceil(q_len / rate) of them ([B, n] each): whether it
    does (its last position is a place of the run), the window, its entry-pool row (0 for a window left
    open), and ([B, n, span] each) where its last `span` raw tokens are: their tail slots (positions
    modulo span) and, for those at or past the group's first position, True and their place in the step
    (`PoolClosing` says what the arguments are)."""
    q_len = in_run.shape[1]
    first = positions.view(-1, q_len)[:, 0, None]
    group_rows = rows.view(-1, q_len)[:, 0]
    device = first.device
    # the i-th position p >= first with (p + 1) % rate == 0
    last = first + (rate - 1 - first) % rate + rate * torch.arange(-(-q_len // rate), device=device)
    offset = last - first  # its place in the group
    closes = (offset < q_len) & in_run.gather(1, offset.clamp(max=q_len - 1))
    window = last // rate
    dst = torch.where(closes, table[group_rows[:, None], torch.where(closes, window, 0) * rate] // rate, 0)
    raw = last[..., None] - torch.arange(span - 1, -1, -1, device=device)
    group = q_len * torch.arange(first.shape[0], device=device)[:, None, None]
    place = (group + raw - first[..., None]).clamp(0, positions.shape[0] - 1)
    return closes, window, dst, raw % span, raw >= first[..., None], place


def pool_closing(
    kv, gate, tail_kv, tail_gate, rows, positions, in_run, table, entries, bias, overlap, norm_weight, eps,
    inv_freq, scaling,
) -> None:  # fmt: skip
    """`PoolClosing`: each window's raw tokens gathered ([B * n, span, width]) and pooled as the last of
    the two windows they span (with overlap) or as one window."""
    m = bias.shape[0]
    span = 2 * m if overlap else m
    closes, window, dst, slots, new, place = closing_windows(rows, positions, in_run, table, m, span)
    group_rows = rows.view(-1, in_run.shape[1])[:, 0, None, None]
    raw_kv = torch.where(new[..., None], kv[place], tail_kv[group_rows, slots]).flatten(0, 1)
    raw_gate = torch.where(new[..., None], gate[place], tail_gate[group_rows, slots]).flatten(0, 1)
    win = window.flatten()
    if overlap:
        raw_gate = raw_gate.clone()
        raw_gate[:, :m].masked_fill_((win < 1)[:, None, None], float("-inf"))  # window 0: no Ca tokens
    windows = raw_kv.shape[1] // m
    norm = partial(rms_norm, weight=norm_weight, eps=eps)
    rope = partial(rope_interleaved, inv_freq=inv_freq, scaling=scaling)
    entry = pool(raw_kv, raw_gate, win - (windows - 1), bias, overlap, norm, rope)[:, -1]
    at, shut = dst.flatten(), closes.flatten()[:, None]
    entries[at] = torch.where(shut, entry.to(entries.dtype), entries[at])  # the others keep their rows

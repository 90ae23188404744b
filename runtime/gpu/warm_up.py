"""Throwaway steps at start-up so the kernels a serving run launches compile now, not under the first
burst of requests (a second or so each on the H200; a machine's first server lost about 2 s to compiles
at its first steps before there was a warm-up).

The attention backend starts every per-row column 16-byte aligned, so each kernel compiles one variant
per launch shape: here the decode kernel on a mixed step's leading rows (0-2 of them), and the prefill
kernel on rows with and without a cached prefix, in its short- and, where the model allows, long-row
launch; last, one step as large as the scheduler's prefill budget (`full_step_shape`). The rows and the
first KV slots it uses are scratch until requests take them: a request writes its KV before it reads it."""

from __future__ import annotations

from collections.abc import Callable

from runtime.config import RunnerConfig
from runtime.mailbox.messages import StepPlan

# (decode rows, their cached prefixes, prefill rows: their cached prefix and new tokens)
Shape = tuple[int, list[int], list[tuple[int, int]]]


def warm_up_shapes(cfg: RunnerConfig, num_slots: int) -> list[Shape]:
    if cfg.max_reqs < 4 or num_slots < 40:
        return []
    shapes = [
        (n_dec, [1] * n_dec, [(0, 16)] + [(1, 16)] * (n_ext - 1)) for n_dec in (0, 1, 2) for n_ext in (1, 2)
    ]
    long_row = 2 * 1024 + 1  # past the prefill kernel's short-row launch
    if cfg.max_model_len > long_row + 1 and num_slots > long_row + 8:
        shapes += [(0, [], [(0, long_row)]), (0, [], [(1, long_row)])]
    if full := full_step_shape(cfg, num_slots):
        shapes.append(full)
    return shapes


def full_step_shape(cfg: RunnerConfig, num_slots: int | None = None) -> Shape | None:
    """The warm-up's largest step, as a mixed step of a serving run looks: two decode rows with long
    contexts (the decode kernel's multi-split launch) beside `max_prefill_tokens` of prefill in rows
    of up to 1024 tokens, the first continuing a cached prefix. It leaves the first full-size step of
    a run its own work only: no first allocations of its activations, no launch shape seen for the
    first time. None when it would not fit or adds nothing over the warm-up's other shapes."""
    total = min(cfg.max_prefill_tokens or 0, (num_slots or cfg.num_kv_slots) - 16)
    row_len = min(1024, cfg.max_model_len - 2)
    if total <= 2 * 1024 + 1 or row_len < 64:
        return None
    n_rows = min(-(-total // row_len), cfg.max_reqs - 2)
    if n_rows < 2:
        return None
    sizes = [row_len] * (n_rows - 1) + [min(row_len, total - row_len * (n_rows - 1))]
    dec_prefix = min(2048, cfg.max_model_len - 2)
    return 2, [dec_prefix] * 2, [(1, sizes[0] - 1)] + [(0, n) for n in sizes[1:]]


def warm_up(cfg: RunnerConfig, num_slots: int, forward: Callable[[StepPlan], object]) -> None:
    """Run every warm-up shape through `forward` (the runner's logits of a plan) in a pool of `num_slots`."""
    for n_dec, dec_prefix, prefills in warm_up_shapes(cfg, num_slots):
        rows = list(range(1, n_dec + len(prefills) + 1))
        prefix = dec_prefix + [p for p, _ in prefills]
        ext = [1] * n_dec + [e for _, e in prefills]
        plan = StepPlan(
            step=-1, added=[], released=[], rows=rows, prefix_lens=prefix, extend_lens=ext,
            use_last=[False] * len(rows), input_ids=[0] * sum(ext), out_loc=list(range(1, sum(ext) + 1)),
            sample=[True] * len(rows),
        )  # fmt: skip
        forward(plan)

"""A step's inputs on the eager path, from its plan: the packed device columns `make_batch` takes, and
what the step samples (the last token of each sampled row, or every position of a row that verifies
drafts); and the host-side checks a plan passes first, so a malformed one is a clear error instead of
a device fault. The graph paths fill their static buffers from the same plan (`cuda_graph.py`).

Rows planned ahead of their previous verify step's counts (`StepPlan.assume_accepted`): the graph
paths move them back on the device; an eager step's attention metadata is built from host lengths, so
`settle` reads the rejected counts first (one device read: free on the CPU, where the previous step has
already run; on CUDA it waits for it, which only mixed steps and eager-only drafters' steps meet)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from runtime.gpu.forward_batch import StepTables, columns_to_device, token_positions
from runtime.mailbox.messages import StepPlan
from runtime.speculative.worker import VerifyRows


@dataclass
class Sampled:
    """What a step samples: `logits` at the sampled positions, the rows that sampled (host and device),
    and for a step with verify rows, each sampled position's row and the rows' blocks."""

    logits: torch.Tensor
    rows: list[int]
    rows_t: torch.Tensor
    pos_rows: list[int] | None = None
    pos_rows_t: torch.Tensor | None = None
    verify: VerifyRows | None = None
    saved: object | None = None  # the pool's saved per-row state of the verify rows' blocks
    saved_rows: torch.Tensor | None = None  # those rows' index among the sampled rows


def _ranges(lens: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each n of `lens`, concatenated."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


def eager_inputs(
    plan: StepPlan, device: torch.device
) -> tuple[list[torch.Tensor], tuple[list[int], list[int], list[int], list[int]], Sampled]:
    """(`make_batch`'s device columns: ids, positions, out_loc, token rows, fed column, rows; its host
    lists; what to sample, `Sampled.logits` holding the sampled token indices until the forward ran)."""
    n = len(plan.rows)
    ext = torch.tensor(plan.extend_lens, dtype=torch.int64)
    rows = torch.tensor(plan.rows, dtype=torch.int64)
    drafts = plan.draft_lens or [0] * n
    positions, starts = token_positions(plan.prefix_lens, plan.extend_lens)
    token_rows = torch.repeat_interleave(rows, ext)
    use_last = torch.repeat_interleave(torch.tensor(plan.use_last, dtype=torch.bool), ext)
    # a fed row's tokens read its fed table: column 0 (its last token), then its drafts 1..k
    fed_col = torch.where(use_last, torch.arange(len(positions)) - torch.repeat_interleave(starts, ext), -1)
    ids = torch.zeros(len(positions), dtype=torch.int64)
    ids[~use_last] = torch.tensor(plan.input_ids, dtype=torch.int64)
    sample = torch.tensor(plan.sample, dtype=torch.bool)
    k = torch.tensor(drafts, dtype=torch.int64)[sample]
    first = (starts + ext - 1)[sample] - k  # each sampled row's first sampled position
    sample_idx = torch.repeat_interleave(first, k + 1) + _ranges(k + 1)
    block_start = torch.cumsum(k + 1, 0) - (k + 1)
    sample_rows = rows[sample]
    pos_rows = torch.repeat_interleave(sample_rows, k + 1)
    owner = torch.repeat_interleave(torch.arange(len(k)), k + 1)
    # aligned columns: with them packed end to end, an odd token count shifted the positions the
    # RoPE kernel reads and compiled a new variant mid-run
    cols = [ids, positions, plan.out_loc, token_rows, fed_col, sample_idx, sample_rows, rows]
    cols += [pos_rows, block_start, k, _ranges(k + 1), owner] if any(drafts) else []
    dev = columns_to_device(cols, device)
    host = (list(plan.rows), list(plan.prefix_lens), list(plan.extend_lens), list(plan.replay))
    rows_list = [r for r, s in zip(plan.rows, plan.sample, strict=True) if s]
    sampled = Sampled(dev[5], rows_list, dev[6])
    if any(drafts):
        ks = k.tolist()
        sampled.pos_rows = [r for r, kk in zip(rows_list, ks, strict=True) for _ in range(kk + 1)]
        sampled.pos_rows_t = dev[8]
        sampled.verify = VerifyRows(ks, dev[9], dev[10], dev[11], dev[12])
    return [*dev[:5], dev[7]], host, sampled


def settle(plan: StepPlan, tables: StepTables) -> StepPlan:
    """The plan with its `assume_accepted` rows at their real places: each moved back by the positions
    its previous verify step rejected, its tokens' KV slots those of its real positions (the rejected
    drafts' slots from the row's table, then the plan's first ones; the plan's last ones go unused)."""
    ahead = [i for i, a in enumerate(plan.assume_accepted) if a]
    if not ahead:
        return plan
    width = tables.fed.shape[1]  # max_draft + 1: more than one verify step rejects
    rows = [plan.rows[i] for i in ahead]
    before = [plan.prefix_lens[i] - width + j for i in ahead for j in range(width)]
    rows_t, before_t = columns_to_device([rows, before], tables.fed.device)
    before_t = before_t.view(len(rows), width)
    slots = tables.req_to_token[rows_t[:, None], before_t.clamp(min=0)]
    read = torch.cat([tables.rejected[rows_t][:, None], slots], 1).tolist()
    prefix, out_loc = list(plan.prefix_lens), list(plan.out_loc)
    starts = [0]
    for e in plan.extend_lens:
        starts.append(starts[-1] + e)
    for i, (back, *earlier) in zip(ahead, read, strict=True):
        s, e = starts[i], plan.extend_lens[i]
        prefix[i] -= back
        out_loc[s : s + e] = (earlier[width - back :] + plan.out_loc[s : s + e])[:e]
    return msgspec.structs.replace(plan, prefix_lens=prefix, out_loc=out_loc, assume_accepted=[])


def check_plan(plan: StepPlan, max_reqs: int, max_model_len: int, max_draft: int) -> None:
    """Host-side checks that turn a malformed plan into a clear error instead of a device fault."""
    n = len(plan.rows)
    drafts = plan.draft_lens or [0] * n
    if len(drafts) != n or any(not 0 <= k <= max_draft for k in drafts):
        raise ValueError(f"step {plan.step}: draft_lens needs one count per row, each in 0..{max_draft}")
    cols = (plan.prefix_lens, plan.extend_lens, plan.use_last, plan.sample)
    if any(len(c) != n for c in cols):
        raise ValueError(f"step {plan.step}: per-row columns differ in length from rows ({n})")
    if len(plan.out_loc) != sum(plan.extend_lens):
        raise ValueError(
            f"step {plan.step}: {len(plan.out_loc)} out_loc for {sum(plan.extend_lens)} new tokens"
        )
    fed = sum(e for e, last in zip(plan.extend_lens, plan.use_last, strict=True) if not last)
    if len(plan.input_ids) != fed:
        raise ValueError(
            f"step {plan.step}: {len(plan.input_ids)} input_ids for {fed} tokens without use_last"
        )
    cols = zip(plan.rows, plan.prefix_lens, plan.extend_lens, plan.use_last, drafts, plan.sample, strict=True)
    for row, p, e, last, k, sample in cols:
        if not 0 < row <= max_reqs:
            raise ValueError(f"step {plan.step}: row {row} outside 1..{max_reqs}")
        if last and e != k + 1:
            raise ValueError(
                f"step {plan.step}: row {row} feeds its last token and {k} drafts but extends by {e}"
            )
        if k and not (last and sample):
            raise ValueError(f"step {plan.step}: row {row} verifies drafts, so it must feed them and sample")
        if p + e > max_model_len:
            raise ValueError(f"step {plan.step}: row {row} reaches {p + e} tokens > max_model_len")
    if plan.assume_accepted and (
        not max_draft
        or len(plan.assume_accepted) != n
        or any(a and not last for a, last in zip(plan.assume_accepted, plan.use_last, strict=True))
    ):
        raise ValueError(
            f"step {plan.step}: assume_accepted needs a drafter and one flag per row, set only on use_last rows"
        )
    if plan.replay:  # replayed tokens come first in a row and leave at least one new token
        if len(plan.replay) != n or any(
            not 0 <= r < e for r, e in zip(plan.replay, plan.extend_lens, strict=True)
        ):
            raise ValueError(
                f"step {plan.step}: replay needs one count per row, each below its extend length"
            )

"""StepPlan builders for tests: slot allocators (flat or page-aligned like the scheduler's), SeqStart,
random prompts."""

from __future__ import annotations

import random

import torch

from runtime.mailbox.messages import SamplingParams, SeqStart, StepPlan

GREEDY = SamplingParams(temperature=0.0)


class PlanBuilder:
    """Builds StepPlans with step numbers and a simple slot allocator (slot 0 never handed out)."""

    def __init__(self, slots: list[int] | None = None) -> None:
        self.step = 0
        self.free = list(slots) if slots is not None else list(range(1, 4096))

    def alloc(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def out_loc(self, rows, prefix_lens, extend_lens, replay) -> list[int]:
        return self.alloc(sum(extend_lens))

    def plan(
        self,
        rows,
        prefix_lens,
        extend_lens,
        input_ids,
        use_last=None,
        sample=None,
        added=(),
        released=(),
        replay=(),
        draft_lens=(),
    ):
        self.step += 1
        return StepPlan(
            step=self.step,
            added=list(added),
            released=list(released),
            rows=list(rows),
            prefix_lens=list(prefix_lens),
            extend_lens=list(extend_lens),
            use_last=list(use_last) if use_last is not None else [False] * len(rows),
            input_ids=list(input_ids),
            out_loc=self.out_loc(rows, prefix_lens, extend_lens, list(replay) or [0] * len(rows)),
            sample=list(sample) if sample is not None else [True] * len(rows),
            replay=list(replay),
            draft_lens=list(draft_lens),
        )


class PagedPlanBuilder(PlanBuilder):
    """StepPlans with the scheduler's slot layout: position p of a row at offset p % page_size of the
    row's (p // page_size)-th page, pages handed out in a shuffled order (so no test relies on contiguous
    slots). A row restarting at position 0 gets fresh pages; `share` starts a row on another row's first
    pages, as a prefix-cache hit does."""

    def __init__(self, page_size: int, num_slots: int = 1024, seed: int = 0) -> None:
        super().__init__([])
        self.page_size = page_size
        self.free_pages = list(range(1, num_slots // page_size))
        random.Random(seed).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {}

    def slot(self, row: int, pos: int) -> int:
        pages, ps = self.pages.setdefault(row, []), self.page_size
        while len(pages) <= pos // ps:
            pages.append(self.free_pages.pop())
        return pages[pos // ps] * ps + pos % ps

    def share(self, row: int, src: int, tokens: int) -> list[int]:
        """Row `row` starts on the first `tokens` positions (whole pages) of row `src`: its prefix slots."""
        assert tokens % self.page_size == 0
        self.pages[row] = list(self.pages[src][: tokens // self.page_size])
        return [self.slot(row, p) for p in range(tokens)]

    def out_loc(self, rows, prefix_lens, extend_lens, replay) -> list[int]:
        out = []
        for row, p, e, rp in zip(rows, prefix_lens, extend_lens, replay, strict=True):
            if p == 0 and not rp:
                self.pages.pop(row, None)  # a new request in this row
            out.extend(self.slot(row, pos) for pos in range(p, p + e))
        return out


def seq_start(
    row: int,
    prompt: list[int],
    params: SamplingParams = GREEDY,
    stop_ids=(),
    prefix_slots=(),
    output_ids=(),
) -> SeqStart:
    """`output_ids`: what a request re-admitted after a retraction had generated."""
    return SeqStart(
        row=row,
        params=params,
        prompt_ids=list(prompt),
        prefix_slots=list(prefix_slots),
        stop_ids=list(stop_ids),
        output_ids=list(output_ids),
    )


def shuffled_slots(seed: int, num_slots: int = 1024) -> list[int]:
    """KV slots 1..num_slots-1 in a seeded random order: tests must not rely on contiguous KV."""
    slots = list(range(1, num_slots))
    random.Random(seed).shuffle(slots)
    return slots


def random_prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def plan_builder(runner, slots: list[int] | None = None) -> PlanBuilder:  # noqa: ANN001
    """Plans in the slot layout the scheduler gives the runner's page size: shuffled pages when it is
    above 1 (`PagedPlanBuilder`), else `slots` one by one."""
    page = runner.page_size
    return PagedPlanBuilder(page, runner.kv_pool.num_slots) if page > 1 else PlanBuilder(slots)


def prefill_then_decode(runner, seqs: list[list[int]], split: int) -> torch.Tensor:  # noqa: ANN001
    """Every sequence (equal lengths) in its own row: their first `split` tokens prefilled in one step,
    then one token each per decode step (CUDA graphs where the runner has them), on shuffled slots
    (shuffled pages with a paged pool). Returns the float32 logits on the CPU, [rows, len - split + 1,
    vocab]: positions split-1 .. end-1."""
    pb = plan_builder(runner, shuffled_slots(0, runner.kv_pool.num_slots))
    rows = list(range(1, len(seqs) + 1))
    added = [seq_start(r, s) for r, s in zip(rows, seqs, strict=True)]
    ids = [t for s in seqs for t in s[:split]]
    steps = [runner.forward_logits(pb.plan(rows, [0] * len(rows), [split] * len(rows), ids, added=added))]
    for pos in range(split, len(seqs[0])):
        plan = pb.plan(rows, [pos] * len(rows), [1] * len(rows), [s[pos] for s in seqs])
        steps.append(runner.forward_logits(plan))
    return torch.stack(steps, dim=1).float().cpu()


def decode_step_without_syncs(runner, params: SamplingParams = GREEDY) -> torch.Tensor:  # noqa: ANN001
    """Prefill three rows, then run one decode step of them (fed-back tokens) and its sampling with
    CUDA's sync debug mode set to "error": a host sync anywhere in the step raises. Returns the tokens."""
    pb, rows = PlanBuilder(), [1, 2, 3]
    runner.execute(
        pb.plan(rows, [0] * 3, [4] * 3, list(range(3, 15)), added=[seq_start(r, [3], params) for r in rows])
    )
    plan = pb.plan(rows, [4] * 3, [1] * 3, [], use_last=[True] * 3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            s = runner._forward_plan(plan)
            tokens = runner.sampler.sample(s.logits, s.rows, s.rows_t).tokens
            runner.tables.last_token[s.rows_t] = tokens
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return tokens

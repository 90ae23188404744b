"""The worker's side of speculative decoding: the drafter, the drafts it keeps between steps (columns 1..K
of the request tables' `fed`), and acceptance after a verify step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.gpu.forward_batch import ForwardBatch, GraphStep, StepTables, columns_to_device
from runtime.gpu.sampler import Block, Sampler, SampleResult
from runtime.mailbox.messages import SeqStart, StepPlan
from runtime.speculative.drafter import Drafter, Drafts, StepTokens
from runtime.speculative.observe_graph import ObserveGraphs
from runtime.speculative.verify import accept


@dataclass(frozen=True)
class VerifyRows:
    """A step's sampled positions when some row verifies drafts: per sampled row its block of
    draft_len + 1 positions (a plain row's block is its one position)."""

    draft_lens: list[int]  # per sampled row
    block_start: torch.Tensor  # [B] each row's first position among the sampled ones
    draft_lens_t: torch.Tensor  # [B]
    # per sampled position, on the device (made on the host and moved with the step's columns: built
    # here from draft_lens_t they would wait for the step to finish)
    offsets_t: torch.Tensor  # [P] its index in its row's block
    owner_t: torch.Tensor  # [P] its row's index among the sampled rows

    @property
    def offsets(self) -> list[int]:
        return [j for k in self.draft_lens for j in range(k + 1)]


@dataclass
class Emitted:
    tokens: torch.Tensor  # [B, W]
    counts: torch.Tensor | None  # [B]; None: one token each
    index: torch.Tensor | None  # [B, W] the sampled position of each emitted token (verify steps)


class Speculation:
    def __init__(self, drafter: Drafter, tables: StepTables) -> None:
        self.drafter, self.tables = drafter, tables
        self.observe_graphs: ObserveGraphs | None = None

    def capture_observe(self, buckets: list[int], capture: bool = True) -> None:
        """Run the drafter's `observe` as CUDA graphs over these batch buckets, if it can."""
        if self.drafter.graph_safe:
            self.observe_graphs = ObserveGraphs(self.drafter, buckets, self.tables.fed.device, capture)

    @property
    def max_draft(self) -> int:
        return self.drafter.max_draft

    def register(self, start: SeqStart) -> None:
        self.drafter.register(start)

    def release(self, row: int) -> None:
        self.drafter.release(row)

    def block(self, rows: list[int], rows_t: torch.Tensor, verify: VerifyRows) -> Block:
        """Each sampled position's earlier drafts in its block (-1 past them), for the sampler."""
        k = self.max_draft
        drafts = self.tables.fed[rows_t, 1:]  # [B, K]
        cols = torch.arange(k, device=rows_t.device)
        prior = torch.where(cols[None, :] < verify.offsets_t[:, None], drafts[verify.owner_t], -1)
        plain = [r for r, k in zip(rows, verify.draft_lens, strict=True) if not k]
        return Block(verify.offsets, prior, plain)

    @staticmethod
    def advance(sampler: Sampler, rows: list[int], verify: VerifyRows):  # noqa: ANN205 - PendingStep's callback
        """The callback that tells the sampler what a verify step's verifying rows (of the sampled `rows`)
        emitted, once the counts reach the host."""
        verifying = [k > 0 for k in verify.draft_lens]
        advance = sampler.advance_later([r for r, v in zip(rows, verifying, strict=True) if v])

        def on_counts(rows: list[int], counts: list[int]) -> None:
            advance([n for n, v in zip(counts, verifying, strict=True) if v])

        return on_counts

    def accept(
        self, sampler: Sampler, result: SampleResult, rows_t: torch.Tensor, verify: VerifyRows
    ) -> Emitted:
        drafts = self.tables.fed[rows_t, 1:]
        tokens, counts, index = accept(result.tokens, verify.block_start, drafts, verify.draft_lens_t)
        sampler.accept(rows_t, tokens, counts)
        # for the rows' next step, if it was planned before these counts reached the host
        self.tables.rejected[rows_t] = verify.draft_lens_t + 1 - counts
        return Emitted(tokens, counts, index)

    def propose(self, rows_t: torch.Tensor, emitted: Emitted, draft: bool = True) -> Drafts | None:
        """After a step: the drafter sees the rows' emitted tokens; drafts it makes now go into their `fed`
        columns 1..K. Without `draft` (`StepPlan.propose`) it only records them, and there are none."""
        counts = emitted.counts if emitted.counts is not None else torch.ones_like(rows_t)
        step = StepTokens(rows_t, emitted.tokens, counts)
        self.drafter.restore(step)
        graphs = self.observe_graphs
        if graphs is not None and graphs.fits(len(rows_t)):
            drafts = graphs.observe(step, draft)
        elif draft:
            drafts = self.drafter.observe(step)
        else:
            drafts = self.drafter.record(step)
        if drafts is not None:
            self.tables.fed[rows_t, 1:] = drafts.tokens
        return drafts

    def capture(self, batch: ForwardBatch, hidden: torch.Tensor, graph: GraphStep | None = None) -> None:
        """After a target forward (eager, or inside a CUDA graph of shape `graph`): drafters that follow
        the target keep what they need of it."""
        if self.drafter.follows_target:
            self.drafter.capture(batch, hidden, graph)

    @property
    def follows_target(self) -> bool:
        return self.drafter.follows_target

    def prepare(self, plan: StepPlan) -> None:
        """Before a step with verify rows: drafters that keep per-row state the step's block overwrites
        learn its rows (`before_verify`)."""
        if not self.drafter.wants_verify_rows:
            return
        ahead = plan.assume_accepted or [False] * len(plan.rows)
        cols = zip(plan.rows, plan.prefix_lens, plan.draft_lens, ahead, strict=True)
        verify = [(r, p, a) for r, p, k, a in cols if k]
        if not verify:
            return
        rows_t, first, behind = columns_to_device(
            [list(c) for c in zip(*verify, strict=True)], self.tables.req_to_token.device
        )
        self.drafter.before_verify(rows_t, first - self.tables.behind(rows_t, behind))

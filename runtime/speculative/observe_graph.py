"""A drafter's `observe` as CUDA graphs, one per (batch bucket, tokens per row): the n-gram lookup is
about 50 small kernels after every step, which issued one by one cost a Llama-8B decode step 5-7% on
the H200 (docs/PERF.md) even when no draft is ever verified; replayed as one graph they cost a few
microseconds of launch. Each bucket also has a graph of the drafter's `record`, replayed after a step
from which no row may verify drafts (`StepPlan.propose`): the lookup's GPU time is then skipped too.

Inputs go through static buffers padded to the bucket: padding rows are row 0 with no tokens (a drafter
appends nothing for them, and their drafts are sliced away). A drafter opts in with `graph_safe` (its
observe is device work of fixed shapes for fixed inputs, as the n-gram drafter's is); its `restore`
runs before, eagerly (Speculation.propose). Off CUDA (or with
`capture=False`) the padded path runs eagerly, which is how the CPU tests check it."""

from __future__ import annotations

import torch

from runtime.speculative.drafter import Drafter, Drafts, StepTokens


class ObserveGraphs:
    def __init__(
        self, drafter: Drafter, buckets: list[int], device: torch.device, capture: bool = True
    ) -> None:
        self.drafter, self.buckets = drafter, buckets
        max_bs, width = buckets[-1], drafter.max_draft + 1
        self.rows = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_bs, width, dtype=torch.int64, device=device)
        self.counts = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, Drafts | None]] = {}
        if self.capture:
            self._capture(device)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def observe(self, step: StepTokens, draft: bool = True) -> Drafts | None:
        """The drafter's `observe` over `step` (without `draft`: its `record`, and no drafts)."""
        n, width = step.tokens.shape
        bs = next(b for b in self.buckets if b >= n)
        self.rows[:n].copy_(step.rows)
        self.tokens[:n, :width].copy_(step.tokens)
        self.counts[:n].copy_(step.counts)
        if bs > n:  # padding rows: row 0, nothing emitted
            self.rows[n:bs].zero_()
            self.counts[n:bs].zero_()
        if self.capture:
            graph, out = self.graphs[bs, width, draft]
            graph.replay()
        else:
            out = self._observe(bs, width, draft)
        if out is None:
            return None
        return Drafts(out.tokens[:n], out.counts[:n], out.confidence[:n])

    def _observe(self, bs: int, width: int, draft: bool) -> Drafts | None:
        step = StepTokens(self.rows[:bs], self.tokens[:bs, :width], self.counts[:bs])
        return self.drafter.observe(step) if draft else self.drafter.record(step)

    def _capture(self, device: torch.device) -> None:
        pool = None
        for width in (1, self.drafter.max_draft + 1):  # plain steps emit one token a row, verify steps more
            for draft in (True, False):
                for bs in reversed(self.buckets):
                    self._observe(bs, width, draft)  # warm-up (padding only: appends nothing)
                    torch.cuda.synchronize(device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._observe(bs, width, draft)
                    pool = graph.pool()
                    self.graphs[bs, width, draft] = (graph, out)
        torch.cuda.synchronize(device)

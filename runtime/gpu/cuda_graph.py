"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed on padded batches.

A decode step (every row one new token, every row sampled) of B rows runs the graph of the smallest
bucket >= B (and, for a backend whose graphs' work grows with the context they are sized for, of the
smallest context bucket that holds its longest row: `AttentionBackend.graph_contexts`). Its inputs
live in one static device buffer, filled per step from a pinned host buffer with one copy; the graph
itself gathers fed-back tokens from `last_token`, writes the new slots into `req_to_token`, runs the
model and writes the logits into a static buffer (in `runner.logits_dtype`: bf16 for Llama). Padding
rows use row 0, position 0, KV slot 0 and length 1: they write and read only the reserved padding slot,
and their logits are sliced away. Mixed and prefill steps run eagerly.

Off CUDA (or with `capture=False`) the same padded static-buffer path runs eagerly: that is how the CPU
tests check the padding and buffer logic against the plain path."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
import torch

from runtime.gpu.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from runtime.gpu.model_runner import ModelRunner
    from runtime.mailbox.messages import StepPlan

log = structlog.get_logger(__name__)

# Rows of the static input buffer, and what a padding row holds in each.
IDS, POS, LOC, ROWS, SEQ_LENS, USE_LAST = range(6)
_PAD = (0, 0, 0, 0, 1, 0)


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 8 up to `max_bs` (which is always the last bucket)."""
    out = [b for b in (1, 2, 4, 8) if b < max_bs]
    out += list(range(16, max_bs, 8))
    return [*out, max_bs]


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_bs: int, capture: bool = True) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_bs)
        self.contexts = runner.attn_backend.graph_contexts(runner.cfg.max_model_len)
        self.max_bs = max_bs
        self.capture_graphs = capture and runner.device.type == "cuda"
        self.enabled = True  # switched off at run time for side-by-side comparisons
        dev, pinned = runner.device, runner.device.type == "cuda"
        # Two pinned host buffers, alternating: with overlap the next step is filled while this step's
        # copy may still be queued behind the running one; an event guards each buffer's reuse.
        self.hosts = [torch.zeros(len(_PAD), max_bs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.inputs = torch.zeros(len(_PAD), max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(max_bs, runner.vocab_size, dtype=runner.logits_dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch, context) buckets
        if self.capture_graphs:
            self._capture()

    def fits(self, plan: StepPlan) -> bool:
        n = len(plan.rows)
        return (
            self.enabled
            and 0 < n <= self.max_bs
            and all(e == 1 for e in plan.extend_lens)
            and all(plan.sample)
        )

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def context(self, plan: StepPlan) -> int:
        longest = max(plan.prefix_lens) + 1
        return next((c for c in self.contexts if c >= longest), self.contexts[-1])

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, V] (a view of the static buffer: consume before the next step) and rows [B]."""
        n = len(plan.rows)
        bs, ctx = self.bucket(n), self.context(plan)
        self._fill(plan, bs)
        if self.capture_graphs:
            self.graphs[bs, ctx].replay()
        else:
            self._forward(bs, ctx)
        return self.logits[:n], self.inputs[ROWS, :n]

    def _fill(self, plan: StepPlan, bs: int) -> None:
        self.turn ^= 1
        host, done = self.hosts[self.turn], self.copied[self.turn]
        if done is not None:
            done.synchronize()  # the copy that last read this buffer has run
        h, n = host.numpy(), len(plan.rows)
        for field, pad in enumerate(_PAD):
            h[field, n:bs] = pad
        if all(plan.use_last):
            h[IDS, :n] = 0
        else:
            fed = iter(plan.input_ids)
            h[IDS, :n] = [0 if last else next(fed) for last in plan.use_last]
        h[POS, :n] = plan.prefix_lens
        h[LOC, :n] = plan.out_loc
        h[ROWS, :n] = plan.rows
        h[SEQ_LENS, :n] = plan.prefix_lens
        h[SEQ_LENS, :n] += 1
        h[USE_LAST, :n] = plan.use_last
        self.inputs.copy_(host, non_blocking=True)
        if self.capture_graphs:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()

    def _forward(self, bs: int, ctx: int) -> None:
        r = self.runner
        ids, pos, loc, rows, seq_lens, use_last = (self.inputs[f, :bs] for f in range(len(_PAD)))
        ids = torch.where(use_last != 0, r.last_token[rows], ids)
        r.req_to_token[rows, pos] = loc
        batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            out_loc=loc,
            rows=rows,
            rows_list=[],
            prefix_lens=[],
            extend_lens=[],
            req_to_token=r.req_to_token,
            kv_cache=r.kv_cache,
            attn_backend=r.attn_backend,
        )
        r.attn_backend.prepare_decode_graph(batch, seq_lens, ctx)
        hidden = r.model(ids, pos, batch)
        self.logits[:bs].copy_(r.model.compute_logits(hidden))

    def _capture(self) -> None:
        t0 = time.perf_counter()
        self.hosts[0].numpy()[:] = torch.tensor(_PAD)[:, None].numpy()
        self.inputs.copy_(self.hosts[0])
        pool = None
        with torch.inference_mode():
            # largest first: smaller graphs reuse its pool memory
            for ctx in reversed(self.contexts):
                for bs in reversed(self.buckets):
                    self._forward(bs, ctx)  # warm-up: compiles Triton kernels, creates cuBLAS handles
                    torch.cuda.synchronize(self.runner.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(bs, ctx)
                    pool = graph.pool()
                    self.graphs[bs, ctx] = graph
        torch.cuda.synchronize(self.runner.device)
        log.info("cuda_graphs_captured", buckets=len(self.buckets), max_bs=self.max_bs, contexts=self.contexts,
                 seconds=round(time.perf_counter() - t0, 2))  # fmt: skip

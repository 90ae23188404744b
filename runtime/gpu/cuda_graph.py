"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed on padded batches.

`GraphRunner` takes what a decode step touches (the model, its attention backend, the KV pool and the
worker's request tables), never the runner that owns them. A decode step (every row one new token,
every row sampled) of B rows runs the graph of the smallest bucket >= B (and, for a backend whose
graphs' work grows with the context they are sized for, of the smallest context bucket that holds its
longest row: `AttentionBackend.graph_contexts`). Its inputs live in one static device buffer, filled per
step from a pinned host buffer with one copy; the graph itself builds the batch (`make_batch`, as eager
steps do: fed-back tokens from the `fed` table, new slots into `req_to_token`), runs the model and writes
the logits into a static buffer (in the model's `logits_dtype`: bf16 for Llama). Padding rows use row 0,
position 0, KV slot 0 and length 1: they write and read only the reserved padding slot, and their
logits are sliced away. Mixed and prefill steps run eagerly.

Rows planned ahead of their previous verify step's counts (`StepPlan.assume_accepted`) are moved back
inside the graph: positions, lengths and KV slots come from the rejected counts the previous step left
on the device (`StepTables.behind`, `make_batch(back=...)`), so nothing waits for the host.

Verify steps (speculative decoding: every row feeds its last token and its drafts, and samples each) run
graphs of their own when the backend can (`supports_verify_graph`), per (batch, context) bucket too:
every row takes q_len = max_draft + 1 token places, consecutive, and a row with fewer drafts leaves its
last places to padding tokens (row 0, position 0, slot 0) whose logits are never read. The backend
attends a row's q_len queries causally over its length `prefix + q_len`; a padding place's query may
read the row's table past its real tokens, which holds valid slots. After the replay one gather picks
the real positions' logits, in the eager path's order.

A hidden-state drafter (mtp, dspark) keeps what it needs of every token's final hidden state and the
tapped layers' outputs (`hidden_sink`, `taps`): its `capture` is fixed-shape device work, captured into
the decode and verify graphs after the model (padding tokens write the padding slot 0).

An Engram model's graphs hash each row's token and gather its table rows on the device
(`EngramRuntime.graph_rows`): only placements that read on the device get graphs.

Data-parallel ranks with expert parallelism exchange MoE tokens in fixed blocks sized by the step's most
tokens on any rank, and a captured graph keeps the block size it was captured with (its bucket's
tokens). So before each step the ranks agree on one graph (`StepGraph`: all replay decode graphs, or all
verify graphs, or all run eagerly) and one batch bucket, the one of the largest batch (`agreed_bs`); a
rank with no rows runs an eager idle step with blocks of that bucket's size (runtime/gpu/lockstep.py).
The padded path sets the exchanges' size itself (`lockstep`), as capture bakes it in, so the CPU runs
check the agreement too. Every padded forward's exchanges take fixed blocks, whatever the bucket's
tokens (`expert_parallel.graphed`): the normal exchange reads counts on the host.

Off CUDA (or with `capture=False`) the same padded static-buffer path runs eagerly: that is how the CPU
tests check the padding and buffer logic against the plain path."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import structlog
import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch, GraphStep, StepTables, make_batch
from runtime.gpu.kv_pool import KVPool
from runtime.gpu.layers.expert_parallel import ExpertParallelMoE, graphed
from runtime.gpu.models.base import CausalLM
from runtime.mailbox.messages import StepPlan

if TYPE_CHECKING:
    from runtime.engram.runtime import EngramRuntime

log = structlog.get_logger(__name__)

# Rows of the static input buffer, and what a padding row holds in each (AHEAD: StepPlan.assume_accepted).
IDS, POS, LOC, ROWS, SEQ_LENS, USE_LAST, AHEAD = range(7)
_PAD = (0, 0, 0, 0, 1, 0, 0)
# The verify graphs' buffer: per token place (row b's places b * q_len ..), then per row (the first
# max_bs entries), then the real positions' logits rows and each one's request row.
V_POS, V_LOC, V_TOKEN_ROW, V_FED, V_ROWS, V_SEQ_LENS, V_SAMPLE, V_POS_ROWS = range(8)
# per row: its first sampled position, its drafts; per sampled position: its index in its row's block,
# its row's index; per token place: its row's StepPlan.assume_accepted
V_BLOCK_START, V_DRAFTS, V_OFFSET, V_OWNER, V_AHEAD = range(8, 13)
_V_FIELDS = 13


class StepGraph(IntEnum):
    """The graph a rank's next step replays; DP ranks agree on one before each step (lockstep.py)."""

    IDLE = -1  # no rows: runs whatever the others agree on (an eager idle step sized alike)
    EAGER = 0
    DECODE = 1
    VERIFY = 2


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 8 up to `max_bs` (which is always the last bucket)."""
    out = [b for b in (1, 2, 4, 8) if b < max_bs]
    out += list(range(16, max_bs, 8))
    return [*out, max_bs]


class GraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        pool: KVPool,
        tables: StepTables,
        *,
        max_bs: int,
        max_model_len: int,
        vocab_size: int,
        capture: bool = True,
        verify_q_len: int = 1,
        engram: EngramRuntime | None = None,
        lockstep: bool = False,
        hidden_sink: Callable[[ForwardBatch, torch.Tensor, GraphStep], None] | None = None,
        taps: tuple[int, ...] = (),
    ) -> None:
        self.model, self.attn, self.pool, self.tables = model, attn, pool, tables
        # the MoE exchanges (expert parallelism) take fixed blocks in every padded forward; DP ranks in
        # `lockstep` size them by the bucket's tokens (as capture bakes in), and `agreed_bs` (set before
        # each step) is the bucket every rank replays
        self.exchanges = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
        self.lockstep = lockstep
        self.hidden_sink, self.taps = hidden_sink, taps
        self.agreed_bs = 0
        self.engram = engram
        self.device = dev = tables.last_token.device
        self.buckets = graph_buckets(max_bs)
        self.contexts = attn.graph_contexts(max_model_len)
        self.max_bs = max_bs
        self.capture_graphs = capture and dev.type == "cuda"
        self.enabled = True  # switched off at run time for side-by-side comparisons
        pinned = dev.type == "cuda"
        # Two pinned host buffers, alternating: with overlap the next step is filled while this step's
        # copy may still be queued behind the running one; an event guards each buffer's reuse.
        self.hosts = [torch.zeros(len(_PAD), max_bs, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.inputs = torch.zeros(len(_PAD), max_bs, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(max_bs, vocab_size, dtype=model.logits_dtype, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (batch, context) buckets
        # verify graphs: q_len token places per row (1: none)
        self.q_len = verify_q_len if attn.supports_verify_graph else 1
        self.max_model_len = max_model_len
        self.verify_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if self.q_len > 1:
            width = max_bs * self.q_len
            self.v_hosts = [
                torch.zeros(_V_FIELDS, width, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
            ]
            self.v_inputs = torch.zeros(_V_FIELDS, width, dtype=torch.int64, device=dev)
            self.v_logits = torch.zeros(width, vocab_size, dtype=model.logits_dtype, device=dev)
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

    def fits_verify(self, plan: StepPlan) -> bool:
        """A step whose every row feeds its last token and drafts (some rows none) and samples them all;
        its rows' q_len places stay inside max_model_len (a padding place's query reads that far)."""
        n = len(plan.rows)
        return (
            self.enabled
            and self.q_len > 1
            and 0 < n <= self.max_bs
            and bool(plan.draft_lens)
            and all(plan.use_last)
            and all(plan.sample)
            and max(plan.prefix_lens) + self.q_len <= self.max_model_len
        )

    def bucket(self, n: int) -> int:
        """The batch bucket a step of n rows replays: the smallest >= n, or the ranks' agreed one."""
        return max(next(b for b in self.buckets if b >= n), self.agreed_bs)

    def tokens(self, kind: StepGraph, rows: int) -> int:
        """The tokens of the padded step of `kind` that holds `rows` rows (its exchanges' size)."""
        return self.bucket(rows) * (self.q_len if kind == StepGraph.VERIFY else 1)

    def context(self, plan: StepPlan) -> int:
        """A decode step's context bucket: its longest row's length with the new token."""
        return self.context_of(max(plan.prefix_lens) + 1)

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

    def run_verify(self, plan: StepPlan) -> VerifyOut:
        """A verify step's logits at the real positions [P, V] (a fresh tensor) and its device columns."""
        n, q = len(plan.rows), self.q_len
        bs, ctx = self.bucket(n), self.context_of(max(plan.prefix_lens) + q)
        num_pos = self._fill_verify(plan, bs)
        if self.capture_graphs:
            self.verify_graphs[bs, ctx].replay()
        else:
            self._forward_verify(bs, ctx)
        v = self.v_inputs
        return VerifyOut(
            self.v_logits[v[V_SAMPLE, :num_pos]], v[V_ROWS, :n], v[V_POS_ROWS, :num_pos],
            v[V_BLOCK_START, :n], v[V_DRAFTS, :n], v[V_OFFSET, :num_pos], v[V_OWNER, :num_pos],
        )  # fmt: skip

    def context_of(self, longest: int) -> int:
        """The smallest context bucket that holds a row of `longest` tokens (the largest otherwise)."""
        return next((c for c in self.contexts if c >= longest), self.contexts[-1])

    def _fill_verify(self, plan: StepPlan, bs: int) -> int:
        """The verify buffer from the plan; returns how many positions are sampled (the real ones)."""
        self.turn ^= 1
        host, done = self.v_hosts[self.turn], self.copied[self.turn]
        if done is not None:
            done.synchronize()
        h, q, n = host.numpy(), self.q_len, len(plan.rows)
        h[:, : bs * q] = 0
        h[V_SEQ_LENS, :bs] = q
        loc = iter(plan.out_loc)
        sampled = 0
        ahead = plan.assume_accepted or [False] * n
        cols = zip(plan.rows, plan.prefix_lens, plan.draft_lens, ahead, strict=True)
        for i, (row, prefix, k, assumed) in enumerate(cols):
            places = slice(i * q, i * q + k + 1)
            h[V_AHEAD, places] = assumed
            h[V_POS, places] = range(prefix, prefix + k + 1)
            h[V_LOC, places] = [next(loc) for _ in range(k + 1)]
            h[V_TOKEN_ROW, places] = row
            h[V_FED, places] = range(k + 1)
            h[V_SAMPLE, sampled : sampled + k + 1] = range(i * q, i * q + k + 1)
            h[V_POS_ROWS, sampled : sampled + k + 1] = row
            h[V_OFFSET, sampled : sampled + k + 1] = range(k + 1)
            h[V_OWNER, sampled : sampled + k + 1] = i
            h[V_BLOCK_START, i] = sampled
            sampled += k + 1
        h[V_ROWS, :n] = plan.rows
        h[V_SEQ_LENS, :n] = plan.prefix_lens
        h[V_SEQ_LENS, :n] += q
        h[V_DRAFTS, :n] = plan.draft_lens
        self.v_inputs.copy_(host, non_blocking=True)
        if self.capture_graphs:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
        return sampled

    def _forward_verify(self, bs: int, ctx: int) -> None:
        t = bs * self.q_len
        pos, loc, token_rows, fed = (self.v_inputs[f, :t] for f in (V_POS, V_LOC, V_TOKEN_ROW, V_FED))
        rows, seq_lens = self.v_inputs[V_ROWS, :bs], self.v_inputs[V_SEQ_LENS, :bs]
        back = self.tables.behind(token_rows, self.v_inputs[V_AHEAD, :t])
        seq_lens = seq_lens - back.view(bs, self.q_len)[:, 0]  # a row's first place is always real
        batch = make_batch(self.tables, self.pool, fed, pos, loc, token_rows, fed, rows, back=back)
        self.attn.prepare_decode_graph(batch, seq_lens, ctx, q_len=self.q_len)
        hidden = self._model(batch, t, GraphStep(seq_lens, ctx, self.q_len))
        self.v_logits[:t].copy_(self.model.compute_logits(hidden))

    def _model(self, batch: ForwardBatch, tokens: int, shape: GraphStep) -> torch.Tensor:
        """The model over a padded batch of `tokens` tokens, its hidden states handed to the sink."""
        if self.taps:
            batch.taps = dict.fromkeys(self.taps)
        with graphed(self.exchanges, tokens if self.lockstep else None):
            hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
        if self.hidden_sink is not None:
            self.hidden_sink(batch, hidden, shape)
        return hidden

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
        h[AHEAD, :n] = plan.assume_accepted or 0
        self.inputs.copy_(host, non_blocking=True)
        if self.capture_graphs:
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()

    def _forward(self, bs: int, ctx: int) -> None:
        ids, pos, loc, rows, seq_lens, use_last, ahead = (self.inputs[f, :bs] for f in range(len(_PAD)))
        back = None
        if self.tables.rejected is not None:  # a speculating runner: rows may be planned ahead
            back = self.tables.behind(rows, ahead)
            seq_lens = seq_lens - back
        batch = make_batch(self.tables, self.pool, ids, pos, loc, rows, use_last - 1, rows, back=back)
        if self.engram is not None:
            batch.engram = self.engram.graph_rows(batch)
        self.attn.prepare_decode_graph(batch, seq_lens, ctx)
        hidden = self._model(batch, bs, GraphStep(seq_lens, ctx, 1))
        self.logits[:bs].copy_(self.model.compute_logits(hidden))

    def _capture(self) -> None:
        t0 = time.perf_counter()
        self.hosts[0].numpy()[:] = torch.tensor(_PAD)[:, None].numpy()
        self.inputs.copy_(self.hosts[0])
        if self.q_len > 1:  # padding everywhere: row 0, position 0, slot 0, length q_len
            self.v_inputs.zero_()
            self.v_inputs[V_SEQ_LENS] = self.q_len
        pool = None
        with torch.inference_mode():
            # largest first: smaller graphs reuse its pool memory
            for ctx in reversed(self.contexts):
                for bs in reversed(self.buckets):
                    self._forward(bs, ctx)  # warm-up: compiles Triton kernels, creates cuBLAS handles
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._forward(bs, ctx)
                    pool = graph.pool()
                    self.graphs[bs, ctx] = graph
                    if self.q_len > 1:
                        self.verify_graphs[bs, ctx] = graph = torch.cuda.CUDAGraph()
                        self._forward_verify(bs, ctx)
                        torch.cuda.synchronize(self.device)
                        with torch.cuda.graph(graph, pool=pool):
                            self._forward_verify(bs, ctx)
        torch.cuda.synchronize(self.device)
        log.info("cuda_graphs_captured", buckets=len(self.buckets), max_bs=self.max_bs, contexts=self.contexts,
                 verify_q_len=self.q_len, seconds=round(time.perf_counter() - t0, 2))  # fmt: skip


@dataclass
class VerifyOut:
    """A verify step's results off its graph: logits of the sampled positions, in the eager path's
    order (each row's block of draft_len + 1), and the device columns the sampler needs."""

    logits: torch.Tensor  # [P, V]
    rows: torch.Tensor  # [B]
    pos_rows: torch.Tensor  # [P] each position's request row
    block_start: torch.Tensor  # [B] each row's first position among the P
    draft_lens: torch.Tensor  # [B]
    offsets: torch.Tensor  # [P] each position's index in its row's block
    owner: torch.Tensor  # [P] each position's row index among the B

"""Drafters that follow the target on the device and draft a chain right after each step: the MTP layer
(mtp.py) and a draft model (draft_model.py). Each keeps a KV pool of its own, addressed through its own
request table with the target's slot numbers (so it needs no allocator), plus K scratch slots per row.

- `capture`, after every target forward (inside its decode and verify CUDA graphs too): the drafter
  computes its own entries for the step's tokens, in their slots: a token at position p is the drafter's
  entry p - `shift` (the draft model's own position p; MTP's entry p - 1, which pairs the hidden state at
  p - 1 with token p). A verify block's places after a rejected draft complete wrong entries, in
  positions and slots the row gives up; per-row state they overwrite (DeepSeek-V4's ring) is saved
  before the step (`before_verify`) and restored once the counts are known (`observe`), as the target's.
- `restore`, right after the step (eager): the saved per-row state of the rejected places, back.
- `observe`, then: the row, now L tokens long, drafts K tokens one at a time from entry L - 1 - `shift`
  on (its last token, which no forward has fed yet), into the scratch slots (the next step completes
  that entry for real); per-row state the chain overwrites is saved and restored inside it.
Attention is planned from device lengths (`prepare_decode_graph`) wherever the host does not know them,
so nothing waits for the host and the scheduler plans rows ahead of their verify step's counts; and
`observe` is fixed-shape device work, so it replays as CUDA graphs (`graph_safe`: K eager layer or model
forwards a step would cost hundreds of launches; a padding row of a graph bucket is row 0 again, which
drafts what row 0 drafts into the same scratch slots). `restore` stays outside the graphs: what it
restores was saved before the step, in tensors shaped by that step's verify rows.
Confidence: 1 (the policy learns each request's acceptance)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch, GraphStep, StepTables, columns_to_device, make_batch
from runtime.gpu.kv_pool import KVPool
from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory


class ChainDrafter(Drafter):
    follows_target = True
    graph_safe = True
    shift = 0  # a token at position p is the drafter's entry p - shift

    def __init__(
        self,
        pool: KVPool,
        attn: AttentionBackend,
        target: StepTables,
        num_slots: int,
        max_draft: int,
        max_len: int,
    ) -> None:
        super().__init__(max_draft)
        rows, device = target.req_to_token.shape[0], target.req_to_token.device
        self.pool, self.attn, self.target, self.scratch = pool, attn, target, num_slots
        self.tables = StepTables.allocate(rows, max_len, device)  # entry of a row -> its KV slot
        self.history = TokenHistory(rows, max_len, device)
        self.max_len, self.context = max_len, attn.graph_contexts(max_len)[-1]
        block = pool.max_verify_block
        if block is not None and max_draft + 1 > block:
            raise ValueError(
                f"the drafter's state rolls back at most {block} entries: use at most {block - 1} drafts"
            )
        # per-row state (V4's ring) that a verify block's entries overwrite: saved before the step
        self.wants_verify_rows = block is not None
        self._saved: tuple[torch.Tensor, object] | None = None

    # ------------------------------------------------------------------ what each drafter does

    @abstractmethod
    def keep(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """What the drafter keeps of a target forward besides its own entries (MTP: hidden states)."""

    @abstractmethod
    def complete(self, entries: ForwardBatch) -> None:
        """Compute the drafter's entries `entries` (its own batch: entry positions, the target's slots)."""

    @abstractmethod
    def chain_start(self, rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor | None:
        """What the chain's first entry reads besides its token (MTP: the hidden state there)."""

    @abstractmethod
    def chain_step(
        self, tokens: torch.Tensor, state: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One entry a row: the logits of the next draft, and what the entry after it reads."""

    # ------------------------------------------------------------------ the contract

    def register(self, start: SeqStart) -> None:
        self.history.register(start)
        self.pool.reset_row(start.row, 0)  # (a replayed prefix hit resets it where its replay starts)
        n = len(start.prefix_slots) - self.shift
        if n > 0:  # a cached prefix holds its tokens' entries in their slots
            slots = torch.tensor(start.prefix_slots[self.shift :], dtype=torch.int64)
            self.tables.req_to_token[start.row, :n] = slots.to(self.tables.req_to_token.device)

    def release(self, row: int) -> None:
        self.pool.release_row(row)

    def before_verify(self, rows: torch.Tensor, first: torch.Tensor) -> None:
        self._saved = rows, self.pool.save_blocks(rows, first - self.shift, self.max_draft + 1)

    def capture(self, batch: ForwardBatch, hidden: torch.Tensor, graph: GraphStep | None = None) -> None:
        self.keep(batch, hidden)
        entries = self._entries(batch) if graph is None else self._graph_entries(batch, graph)
        if entries is not None:
            self.complete(entries)

    def restore(self, step: StepTokens) -> None:
        """The per-row state the last verify block's rejected places overwrote, back."""
        if self._saved is None:
            return
        (rows, saved), self._saved = self._saved, None
        kept = torch.zeros(self.tables.req_to_token.shape[0], dtype=torch.int64, device=rows.device)
        kept[step.rows] = step.counts
        self.pool.restore_rejected(saved, kept[rows])

    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        return self._draft(step.rows)

    def record(self, step: StepTokens) -> None:
        self.history.append(step)

    # ------------------------------------------------------------------ entries

    def _entries(self, batch: ForwardBatch) -> ForwardBatch | None:
        """An eager step's entries: each token at a position >= shift, `shift` positions back."""
        keep, rows, prefix, extend, replay, start = [], [], [], [], [], 0
        replays = batch.replay_lens or [0] * len(batch.rows_list)
        for row, p, n, rp in zip(batch.rows_list, batch.prefix_lens, batch.extend_lens, replays, strict=True):
            drop = min(max(self.shift - p, 0), n)  # tokens whose entry would sit before position 0
            if n > drop:
                keep += range(start + drop, start + n)
                rows.append(row)
                prefix.append(max(p - self.shift, 0))
                extend.append(n - drop)
                replay.append(max(rp - drop, 0))
            start += n
        if not keep:
            return None
        idx, rows_t = columns_to_device([keep, rows], batch.input_ids.device)
        ids = batch.input_ids[idx]
        entries = make_batch(
            self.tables, self.pool, ids, batch.positions[idx] - self.shift, batch.out_loc[idx],
            batch.token_rows[idx], torch.full_like(ids, -1), rows_t,
            (rows, prefix, extend, replay if batch.replay_lens else []),
        )  # fmt: skip
        self.attn.prepare(entries)
        return entries

    def _graph_entries(self, batch: ForwardBatch, graph: GraphStep) -> ForwardBatch:
        """A graph step's entries, place for place (q_len a row); a token whose entry would sit before
        position 0 (padding) is padding again (row 0, position 0, slot 0)."""
        real = batch.positions >= self.shift
        entries = make_batch(
            self.tables, self.pool, batch.input_ids,
            torch.where(real, batch.positions - self.shift, 0), torch.where(real, batch.out_loc, 0),
            torch.where(real, batch.token_rows, 0), torch.full_like(batch.input_ids, -1), batch.rows,
        )  # fmt: skip
        seq_lens = (graph.seq_lens - self.shift).clamp(min=graph.q_len)  # a padding row keeps q_len
        self.attn.prepare_decode_graph(entries, seq_lens, graph.max_seq_len, graph.q_len)
        return entries

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def _draft(self, rows: torch.Tensor) -> Drafts:
        k = self.max_draft
        n = self.history.length[rows]
        first = (n - 1 - self.shift).clamp(min=0)  # the entry of the row's last token
        # (a row with no tokens, a graph bucket's padding row, reads the history's -1: token 0 instead)
        tok = self.history.ids[rows, (n - 1).clamp(min=0)].clamp(min=0)
        state = self.chain_start(rows, first)
        saved = self.pool.save_blocks(rows, first, k) if self.wants_verify_rows else None
        no_fed, scratch, tokens = torch.full_like(rows, -1), self.scratch + rows * k, []
        for j in range(k):
            pos = (first + j).clamp(max=self.max_len - 1)  # (drafts past max_len are never verified)
            batch = make_batch(self.tables, self.pool, tok, pos, scratch + j, rows, no_fed, rows)
            self.attn.prepare_decode_graph(batch, pos + 1, self.context)
            logits, state = self.chain_step(tok, state, batch)
            tok = logits.argmax(-1)
            tokens.append(tok)
        if saved is not None:
            self.pool.restore_rejected(saved, torch.zeros_like(first))
        ones = torch.ones(len(rows), k, device=rows.device)
        return Drafts(torch.stack(tokens, 1), torch.full_like(n, k), ones)

"""MTP drafting: DeepSeek's multi-token-prediction layer (`nextn`: `model.layers.{num_hidden_layers}` in
V3 checkpoints, `mtp.0.*` in V4's) proposes the drafts from the target's own hidden states, chained for
K > 1. V3's layer reads the target's final hidden state; V4's block reads the last layer's hyper-connection
streams (tapped during the forward) and keeps a sliding-window ring per row in its own pool.

The MTP layer is a full decoder layer over its own sequence: entry i combines the target's hidden state
at position i with the embedding of token i + 1, and its output predicts token i + 2. It attends over
entries 0..i, so it keeps its own KV (one layer of the family's pool). Entry i depends on tokens 0..i + 1
only, so its KV lives in the target's slot of position i + 1: a radix-cached prefix holds exactly the
entries of its own tokens, and a request never writes a slot it shares.

Everything runs on the device, in step with the target, so a row's next step may be planned before this
step's counts reach the host (`drafts_ahead`), as SGLang's MTP overlap does:
- `capture`, after every target forward (inside its CUDA graphs too): the hidden states are kept per KV
  slot, and each token of the step (position p, slot s) completes entry p - 1 with the hidden state of
  p - 1, its KV in s. A verify block's places after a rejected draft complete wrong entries, in slots
  and positions the row gives up; on V4 the ring entries they overwrite are saved before the step
  (`before_verify`) and restored once the counts are known (`observe`), as the target's are.
- `observe`, right after the step: entry L - 2 of a row now L tokens long (the last accepted position's
  hidden state, the token the step emitted last) predicts the first draft, and each further draft j runs
  the layer once more at entry L - 2 + j on its own previous output and draft j's embedding (the chain).
  These K entries go to K scratch slots a row (entry L - 2 is completed for real by the next step, which
  feeds token L - 1); V4's ring entries they overwrite are restored after drafting. Their attention is
  planned from device lengths (`prepare_decode_graph`).
Confidence: 1 (the layer's own probability is not calibrated; the policy learns each request's
acceptance)."""

from __future__ import annotations

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch, GraphStep, StepTables, columns_to_device, make_batch
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.models.base import CausalLM
from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory


class MTPDrafter(Drafter):
    wants_hidden = True
    drafts_ahead = True

    def __init__(
        self,
        model: CausalLM,
        backend: str,
        target: StepTables,
        num_slots: int,
        max_draft: int,
        max_len: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(max_draft)
        if not model.mtp_layers:
            raise ValueError(
                f"--speculative-algorithm mtp needs MTP (nextn) layers; {type(model).__name__} has none "
                "(the checkpoint has no model.layers.{num_hidden_layers}.* tensors)"
            )
        rows, device = target.req_to_token.shape[0], target.req_to_token.device
        self.model, self.target, self.scratch = model, target, num_slots
        spec = KVPoolSpec(num_slots + rows * max_draft, rows, dtype, device, max_len)
        self.pool = model.make_mtp_kv_pool(spec)
        self.attn: AttentionBackend = model.make_attention_backend(backend, 1)
        self.tables = StepTables.allocate(rows, max_len, device)  # entry i of a row -> its KV slot
        self.history = TokenHistory(rows, max_len, device)
        self.max_len, self.context = max_len, self.attn.graph_contexts(max_len)[-1]
        # what the MTP layer reads of the target: its final hidden state (V3), or a tapped layer's output
        # (V4: the last layer's streams [n, D], before the hyper-head)
        self.tap: int | None = model.mtp_hidden_tap
        self.taps = () if self.tap is None else (self.tap,)
        d = model.config.hidden_size
        shape = (num_slots, d) if self.tap is None else (num_slots, model.config.hc_mult, d)
        self.hidden = torch.zeros(shape, dtype=dtype, device=device)
        block = self.pool.max_verify_block
        if block is not None and max_draft + 1 > block:
            raise ValueError(
                f"the MTP block rolls back at most {block} entries: use at most {block - 1} drafts"
            )
        # per-row state (V4's ring) that a verify block's entries overwrite: saved before the step
        self.wants_verify_rows = block is not None
        self._saved: tuple[torch.Tensor, object] | None = None

    def register(self, start: SeqStart) -> None:
        self.history.register(start)
        self.pool.reset_row(start.row, 0)  # (a replayed prefix hit resets it where its replay starts)
        n = len(start.prefix_slots)
        if n > 1:  # a cached prefix: its entries 0 .. n - 2 live in the slots of positions 1 .. n - 1
            slots = torch.tensor(start.prefix_slots[1:], dtype=torch.int64)
            self.tables.req_to_token[start.row, : n - 1] = slots.to(self.tables.req_to_token.device)

    def release(self, row: int) -> None:
        self.pool.release_row(row)

    def before_verify(self, rows: torch.Tensor, first: torch.Tensor) -> None:
        # the block's tokens at first .. first + K complete entries first - 1 .. first + K - 1
        self._saved = rows, self.pool.save_blocks(rows, first - 1, self.max_draft + 1)

    def capture(self, batch: ForwardBatch, hidden: torch.Tensor, graph: GraphStep | None = None) -> None:
        h = hidden if self.tap is None else batch.taps[self.tap]
        self.hidden[batch.out_loc] = h.to(self.hidden.dtype)
        entries = self._entries(batch) if graph is None else self._graph_entries(batch, graph)
        if entries is not None:
            prev = self.hidden[self.target.req_to_token[entries.token_rows, entries.positions]]
            self.model.mtp_forward(0, entries.input_ids, prev, entries.positions, entries, self.attn)

    def _entries(self, batch: ForwardBatch) -> ForwardBatch | None:
        """An eager step's entries: each token but a row's first at position 0, one position back."""
        keep, rows, prefix, extend, replay, start = [], [], [], [], [], 0
        for row, p, n, rp in zip(
            batch.rows_list, batch.prefix_lens, batch.extend_lens, batch.replay_lens or [0] * len(batch.rows_list),
            strict=True,
        ):  # fmt: skip
            drop = int(p == 0 and n > 0)
            if n > drop:
                keep += range(start + drop, start + n)
                rows.append(row)
                prefix.append(max(p - 1, 0))
                extend.append(n - drop)
                replay.append(max(rp - drop, 0))
            start += n
        if not keep:
            return None
        idx, rows_t = columns_to_device([keep, rows], batch.input_ids.device)
        ids = batch.input_ids[idx]
        entries = make_batch(
            self.tables, self.pool, ids, batch.positions[idx] - 1, batch.out_loc[idx], batch.token_rows[idx],
            torch.full_like(ids, -1), rows_t, (rows, prefix, extend, replay if batch.replay_lens else []),
        )  # fmt: skip
        self.attn.prepare(entries)
        return entries

    def _graph_entries(self, batch: ForwardBatch, graph: GraphStep) -> ForwardBatch:
        """A graph step's entries, place for place (q_len a row): a token at position 0 (padding) is
        padding again (row 0, position 0, slot 0)."""
        real = batch.positions > 0
        entries = make_batch(
            self.tables, self.pool, batch.input_ids,
            torch.where(real, batch.positions - 1, 0), torch.where(real, batch.out_loc, 0),
            torch.where(real, batch.token_rows, 0), torch.full_like(batch.input_ids, -1), batch.rows,
        )  # fmt: skip
        seq_lens = (graph.seq_lens - 1).clamp(min=graph.q_len)  # a padding row keeps q_len
        self.attn.prepare_decode_graph(entries, seq_lens, graph.max_seq_len, graph.q_len)
        return entries

    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        self._restore(step)
        return self._draft(step.rows)

    def record(self, step: StepTokens) -> None:
        self.history.append(step)
        self._restore(step)

    def _restore(self, step: StepTokens) -> None:
        """V4: the ring entries the last verify block's rejected places overwrote, back."""
        if self._saved is None:
            return
        (rows, saved), self._saved = self._saved, None
        kept = torch.zeros(self.tables.req_to_token.shape[0], dtype=torch.int64, device=rows.device)
        kept[step.rows] = step.counts
        self.pool.restore_rejected(saved, kept[rows])

    @torch.inference_mode()
    def _draft(self, rows: torch.Tensor) -> Drafts:
        k = self.max_draft
        n = self.history.length[rows]
        first = (n - 2).clamp(min=0)  # entry L - 2 predicts the first draft
        out = self.hidden[self.target.req_to_token[rows, first]]
        tok = self.history.ids[rows, (n - 1).clamp(min=0)]
        saved = self.pool.save_blocks(rows, first, k) if self.wants_verify_rows else None
        no_fed, scratch = torch.full_like(rows, -1), self.scratch + rows * k
        tokens = []
        for j in range(k):
            pos = (first + j).clamp(max=self.max_len - 1)  # (drafts past max_len are never verified)
            batch = make_batch(self.tables, self.pool, tok, pos, scratch + j, rows, no_fed, rows)
            self.attn.prepare_decode_graph(batch, pos + 1, self.context)
            streams = out if self.tap is None or j == 0 else out[:, None].expand(-1, self.hidden.shape[1], -1)
            out = self.model.mtp_forward(0, tok, streams, pos, batch, self.attn)
            tok = self.model.compute_logits(out).argmax(-1)
            tokens.append(tok)
        if saved is not None:
            self.pool.restore_rejected(saved, torch.zeros_like(first))
        ones = torch.ones(len(rows), k, device=rows.device)
        return Drafts(torch.stack(tokens, 1), torch.full_like(n, k), ones)

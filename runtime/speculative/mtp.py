"""MTP drafting: DeepSeek's multi-token-prediction layer (`nextn`: `model.layers.{num_hidden_layers}` in
V3 checkpoints, `mtp.0.*` in V4's) proposes the drafts from the target's own hidden states, chained for
K > 1. V3's layer reads the target's final hidden state; V4's block reads the last layer's hyper-connection
streams (tapped during the forward), keeps a sliding-window ring per row in its own pool, and the chain's
ring entries are restored after drafting (`KVPool.save_blocks` / `restore_rejected`), as a verify step
restores the target's.

The MTP layer is a full decoder layer over its own sequence: entry i combines the target's final hidden
state at position i with the embedding of token i + 1, and its output predicts token i + 2. It attends
over entries 0..i, so it keeps its own KV (one layer of the family's pool). Entry i depends on tokens
0..i + 1 only, so its KV lives in the target's slot of position i + 1 (a radix-cached prefix holds exactly
the entries of its own tokens, and a request never writes a slot it shares); the chained entries past
the row's last token, and their KV, go to K scratch slots per row.

The target's final hidden state of every token it computes is kept per KV slot (`capture`, after each
forward), so the drafter can catch up lazily. Just before a step that verifies a row of length L (its
last token, at L - 1, is fed by that step): entries `done .. L - 2` are computed (their hidden states
and next tokens are known; the slot of L - 1 is the step's), entry L - 2 predicts the first draft, and
each further draft j runs the layer once more at entry L - 2 + j on its own previous output and draft
j's embedding (the chain). Confidence: the layer's probability of its own token."""

from __future__ import annotations

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import ForwardBatch, StepTables, columns_to_device, make_batch
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.models.base import CausalLM
from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory


class MTPDrafter(Drafter):
    wants_hidden = True

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
        self.tables = StepTables.allocate(rows, max_len, device)
        self.history = TokenHistory(rows, max_len, device)
        # what the MTP layer reads of the target: its final hidden state (V3), or a tapped layer's output
        # (V4: the last layer's streams [n, D], before the hyper-head)
        self.tap: int | None = model.mtp_hidden_tap
        self.taps = () if self.tap is None else (self.tap,)
        d = model.config.hidden_size
        shape = (num_slots, d) if self.tap is None else (num_slots, model.config.hc_mult, d)
        self.hidden = torch.zeros(shape, dtype=dtype, device=device)
        block = self.pool.max_verify_block
        if block is not None and max_draft - 1 > block:
            raise ValueError(
                f"the MTP chain rolls back at most {block} entries: use at most {block + 1} drafts"
            )
        self.done: dict[int, int] = {}  # row -> entries whose KV the drafter holds (0 .. done - 1)

    def register(self, start: SeqStart) -> None:
        self.history.register(start)
        self.done[start.row] = 0

    def release(self, row: int) -> None:
        self.done.pop(row, None)
        self.pool.release_row(row)

    def capture(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        h = hidden if self.tap is None else batch.taps[self.tap]
        self.hidden[batch.out_loc] = h.to(self.hidden.dtype)

    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        n, k = step.rows.shape[0], self.max_draft
        ones = torch.ones(n, k, device=step.rows.device)
        return Drafts(None, torch.full((n,), k, device=step.rows.device), ones)

    @torch.inference_mode()
    def prepare(self, rows: list[int], lengths: list[int]) -> Drafts:
        k, device = self.max_draft, self.target.req_to_token.device
        starts = [self.done.get(r, 0) for r in rows]
        ends = [n - 1 for n in lengths]  # entries start .. n - 2
        extend = [e - s for s, e in zip(starts, ends, strict=True)]
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        token_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(extend))
        last = torch.cumsum(torch.tensor(extend), 0) - 1
        pos_d, rows_d, token_rows_d, last_d = columns_to_device([pos, rows, token_rows, last], device)
        slots = self.target.req_to_token[token_rows_d, pos_d + 1]
        hidden = self.hidden[self.target.req_to_token[token_rows_d, pos_d]]
        next_ids = self.history.ids[token_rows_d, pos_d + 1]
        out = self._forward(next_ids, hidden, pos_d, slots, token_rows_d, rows_d, (rows, starts, extend))
        out = out[last_d]
        tokens, probs = [], []
        # the chain's entries are scratch: per-row state they write in place (V4's ring) is restored
        first = torch.tensor([n - 1 for n in lengths]).to(device, non_blocking=True)
        saved = self.pool.save_blocks(rows_d, first, k - 1) if k > 1 else None
        for j in range(k):
            p = torch.softmax(self.model.compute_logits(out).float(), dim=-1)
            conf, tok = p.max(dim=-1)
            tokens.append(tok)
            probs.append(conf)
            if j == k - 1:
                break
            # entry n - 2 + j + 1 (position n - 1 + j): the previous output and draft j + 1's embedding
            prefix = [n - 1 + j for n in lengths]
            scratch = [self.scratch + r * k + j for r in rows]
            pos_j, slots_j = columns_to_device([prefix, scratch], device)
            streams = out if self.tap is None else out[:, None].expand(-1, self.hidden.shape[1], -1)
            out = self._forward(tok, streams, pos_j, slots_j, rows_d, rows_d, (rows, prefix, [1] * len(rows)))
        if saved is not None:
            self.pool.restore_rejected(saved, torch.zeros_like(first))
        for r, n in zip(rows, lengths, strict=True):
            self.done[r] = n - 1
        return Drafts(
            torch.stack(tokens, 1), torch.full((len(rows),), k, device=device), torch.stack(probs, 1)
        )

    def _forward(self, next_ids, hidden, positions, slots, token_rows, rows, host) -> torch.Tensor:  # noqa: ANN001
        """The MTP layer's output (normed hidden states) of every entry fed, over its own pool."""
        rows_list, prefix, extend = host
        no_fed = torch.full_like(next_ids, -1)
        batch = make_batch(
            self.tables, self.pool, next_ids, positions, slots, token_rows, no_fed, rows,
            (rows_list, prefix, extend, []),
        )  # fmt: skip
        self.attn.prepare(batch)
        return self.model.mtp_forward(0, batch.input_ids, hidden, batch.positions, batch, self.attn)

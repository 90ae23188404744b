"""A draft model: a smaller checkpoint of the same tokenizer (any family with a `CausalLM`) proposes the
drafts greedily, K forward passes of its own per verify step.

The draft model keeps its own KV pool, paged like the target's and addressed through its own request
table. Positions the target has written (everything before the row's last token) take the target's slot
numbers, so the draft pool needs no allocator of its own: it has the target's slots, plus K scratch slots
per row for the row's last token (its target slot is only entered by the step about to run) and the
positions it drafts; those are recomputed at the next turn, once the target has written them.
Just before a step that verifies a row (`prepare`: the host knows the row's length from the plan), the
draft model catches up on the tokens it has not seen (the accepted drafts and the target's token since
its last turn, or the whole prompt the first time; token ids from the device history), then drafts one
token at a time. Confidence: the draft model's probability of its own token."""

from __future__ import annotations

import torch

from runtime.gpu.attention.base import AttentionBackend
from runtime.gpu.forward_batch import StepTables, columns_to_device, make_batch
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.models.base import CausalLM
from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory


class DraftModelDrafter(Drafter):
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
        rows, device = target.req_to_token.shape[0], target.req_to_token.device
        self.model, self.target, self.scratch = model, target, num_slots
        spec = KVPoolSpec(num_slots + rows * max_draft, rows, dtype, device, max_len)
        self.pool = model.make_kv_pool(spec)
        self.attn: AttentionBackend = model.make_attention_backend(backend, 1)
        self.tables = StepTables.allocate(rows, max_len, device)
        self.history = TokenHistory(rows, max_len, device)
        self.done: dict[int, int] = {}  # row -> positions whose KV the draft pool holds

    def register(self, start: SeqStart) -> None:
        self.history.register(start)
        self.done[start.row] = 0

    def release(self, row: int) -> None:
        self.done.pop(row, None)

    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        n, k = step.rows.shape[0], self.max_draft
        ones = torch.ones(n, k, device=step.rows.device)
        return Drafts(None, torch.full((n,), k, device=step.rows.device), ones)

    @torch.inference_mode()
    def prepare(self, rows: list[int], lengths: list[int]) -> Drafts:
        k, device = self.max_draft, self.target.req_to_token.device
        starts = [self.done.get(r, 0) for r in rows]
        tokens, probs = [], []
        # catch up on positions start .. length - 1 (the last of them is the row's last token)
        pos = torch.cat([torch.arange(s, n) for s, n in zip(starts, lengths, strict=True)])
        token_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths) - torch.tensor(starts))
        extend = [n - s for s, n in zip(starts, lengths, strict=True)]
        last = torch.cumsum(torch.tensor(extend), 0) - 1
        pos_d, rows_d, token_rows_d, last_d = columns_to_device([pos, rows, token_rows, last], device)
        ids = self.history.ids[token_rows_d, pos_d]
        scratch = torch.tensor([self.scratch + r * k for r in rows])
        is_last = torch.zeros(len(pos), dtype=torch.bool)
        is_last[last] = True
        scratch_d, is_last_d = columns_to_device(
            [torch.repeat_interleave(scratch, torch.tensor(extend)), is_last], device
        )
        slots = torch.where(is_last_d != 0, scratch_d, self.target.req_to_token[token_rows_d, pos_d])
        logits = self._forward(ids, pos_d, slots, token_rows_d, rows_d, (rows, starts, extend))[last_d]
        for j in range(k):
            p = torch.softmax(logits.float(), dim=-1)
            conf, tok = p.max(dim=-1)
            tokens.append(tok)
            probs.append(conf)
            if j == k - 1:
                break
            # draft j + 1 at position length + j, in the row's scratch slot j + 1
            prefix = [n + j for n in lengths]
            scratch_j = [self.scratch + r * k + j + 1 for r in rows]
            pos_j, slots_j = columns_to_device([prefix, scratch_j], device)
            logits = self._forward(tok, pos_j, slots_j, rows_d, rows_d, (rows, prefix, [1] * len(rows)))
        for r, n in zip(rows, lengths, strict=True):
            self.done[r] = n - 1  # the last token's KV sits in scratch: recomputed at its real slot next time
        return Drafts(
            torch.stack(tokens, 1), torch.full((len(rows),), k, device=device), torch.stack(probs, 1)
        )

    def _forward(self, ids, positions, slots, token_rows, rows, host) -> torch.Tensor:  # noqa: ANN001
        """Logits of every fed token (the draft model's own step over its pool)."""
        rows_list, prefix, extend = host
        no_fed = torch.full_like(ids, -1)
        batch = make_batch(
            self.tables, self.pool, ids, positions, slots, token_rows, no_fed, rows,
            (rows_list, prefix, extend, []),
        )  # fmt: skip
        self.attn.prepare(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch, self.attn)
        return self.model.compute_logits(hidden)

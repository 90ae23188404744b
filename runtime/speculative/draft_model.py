"""A draft model: a smaller checkpoint of the same tokenizer (any family with a `CausalLM`) proposes the
drafts greedily, one forward pass of its own per draft.

It follows the target on the device (chain.py): its own KV pool takes the target's slot numbers for the
positions the target writes (every token of every target step is fed through the draft model too, in
its slot, inside the target's CUDA graphs as well), plus K scratch slots per row for the positions it
drafts. Right after a step it feeds the row's last token (the one the step emitted, not yet fed to
either model) and each draft in turn; those scratch entries are recomputed in their real slots by the
next step."""

from __future__ import annotations

import torch

from runtime.gpu.forward_batch import ForwardBatch, StepTables
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.models.base import CausalLM
from runtime.speculative.chain import ChainDrafter


class DraftModelDrafter(ChainDrafter):
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
        rows, device = target.req_to_token.shape[0], target.req_to_token.device
        pool = model.make_kv_pool(KVPoolSpec(num_slots + rows * max_draft, rows, dtype, device, max_len))
        super().__init__(
            pool, model.make_attention_backend(backend, 1), target, num_slots, max_draft, max_len
        )
        self.model = model

    def keep(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        return

    def complete(self, entries: ForwardBatch) -> None:
        self.model(entries.input_ids, entries.positions, entries, self.attn)

    def chain_start(self, rows: torch.Tensor, first: torch.Tensor) -> None:
        return None

    def chain_step(
        self, tokens: torch.Tensor, state: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, None]:
        return self.model.compute_logits(self.model(tokens, batch.positions, batch, self.attn)), None

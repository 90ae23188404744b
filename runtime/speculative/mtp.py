"""MTP drafting: DeepSeek's multi-token-prediction layer (`nextn`: `model.layers.{num_hidden_layers}` in
V3 checkpoints, `mtp.0.*` in V4's) proposes the drafts from the target's own hidden states, chained for
K > 1. V3's layer reads the target's final hidden state; V4's block reads the last layer's hyper-connection
streams (tapped during the forward) and keeps a sliding-window ring per row in its own pool.

The MTP layer is a full decoder layer over its own sequence: entry i combines the target's hidden state
at position i with the embedding of token i + 1, and its output predicts token i + 2. It attends over
entries 0..i, so it keeps its own KV (one layer of the family's pool). Entry i depends on tokens 0..i + 1
only, so its KV lives in the target's slot of position i + 1 (`shift` 1): a radix-cached prefix holds
exactly the entries of its own tokens, and a request never writes a slot it shares.

It follows the target on the device (chain.py): the hidden states are kept per KV slot and each token
of a step completes its entry, inside the target's CUDA graphs too (V3: the entry's latent alone,
`mtp_store_kv`; V4: the whole block); right after the step, entry L - 2 of
a row now L tokens long (the last accepted position's hidden state, the token the step emitted last)
predicts the first draft, and each further draft j runs the layer once more at entry L - 2 + j on its
own previous output and draft j's embedding."""

from __future__ import annotations

import torch

from runtime.gpu.forward_batch import ForwardBatch, StepTables
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.models.base import CausalLM
from runtime.speculative.chain import ChainDrafter


class MTPDrafter(ChainDrafter):
    shift = 1

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
        if not model.mtp_layers:
            raise ValueError(
                f"--speculative-algorithm mtp needs MTP (nextn) layers; {type(model).__name__} has none "
                "(the checkpoint has no model.layers.{num_hidden_layers}.* tensors)"
            )
        rows, device = target.req_to_token.shape[0], target.req_to_token.device
        pool = model.make_mtp_kv_pool(KVPoolSpec(num_slots + rows * max_draft, rows, dtype, device, max_len))
        super().__init__(
            pool, model.make_attention_backend(backend, 1), target, num_slots, max_draft, max_len
        )
        self.model = model
        # what the MTP layer reads of the target: its final hidden state (V3), or a tapped layer's output
        # (V4: the last layer's streams [n, D], before the hyper-head)
        self.tap: int | None = model.mtp_hidden_tap
        self.taps = () if self.tap is None else (self.tap,)
        d = model.config.hidden_size
        shape = (num_slots, d) if self.tap is None else (num_slots, model.config.hc_mult, d)
        self.hidden = torch.zeros(shape, dtype=dtype, device=device)

    def keep(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        h = hidden if self.tap is None else batch.taps[self.tap]
        self.hidden[batch.out_loc] = h.to(self.hidden.dtype)

    def complete(self, entries: ForwardBatch) -> None:
        prev = self.hidden[self.target.req_to_token[entries.token_rows, entries.positions]]
        self.model.mtp_store_kv(0, entries.input_ids, prev, entries.positions, entries, self.attn)

    def chain_start(self, rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return self.hidden[self.target.req_to_token[rows, first]]

    def chain_step(
        self, tokens: torch.Tensor, state: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model.mtp_forward(0, tokens, state, batch.positions, batch, self.attn)
        # the next entry reads this one's output (V4: as every stream)
        nxt = out if self.tap is None else out[:, None].expand(-1, self.hidden.shape[1], -1)
        return self.model.compute_logits(out), nxt

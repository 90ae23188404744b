"""MLA prefill (DeepSeek-V2/V3, expanded form): every prefill row of a step at once, ragged. q [T, H, dqk]
against per-head K [S, H, dqk] and V [S, H, dv] (the row's latents already expanded), causal with each
row's queries the last of its keys; out [T, H, dv]. Ours (Triton) on CUDA, then the reference."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, triton_on_cuda


class MlaPrefill(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        kv_starts: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        max_q_len: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, dqk]; k [S, H, dqk]; v [S, H, dv] (each with a contiguous last dim; d_qk = nope +
        rope need not be a power of two, d_qk != d_v); the four row columns [B] (int32 or int64), with
        q_lens[b] <= kv_lens[b] (not checked by kernels: no device sync). Row b's queries
        q[q_starts[b] : +q_lens[b]] are the last q_lens[b] positions of its keys
        k[kv_starts[b] : +kv_lens[b]], so query i sees keys 0 .. prefix + i (prefix = kv_lens - q_lens,
        the cached part). Returns out [T, H, dv] in q's dtype (`out` if given); tokens of no row are left
        as they were. `max_q_len`: the longest row's queries, known on the host, sizes a kernel's grid
        (None: all of q's tokens, correct with some programs idle); the reference ignores it."""
        ...


MLA_PREFILL = Op("mla_prefill", MlaPrefill)
MLA_PREFILL.register("triton", "runtime.gpu.kernels.mla_prefill.triton:mla_prefill", triton_on_cuda)
MLA_PREFILL.register("reference", "runtime.gpu.kernels.mla_prefill.reference:mla_prefill", always)

"""MLA decode (DeepSeek-V2/V3, absorbed form) on the paged latent cache: q [B, Hq, r + rope] against
one latent row per token, out [B, Hq, r]. FlashMLA when importable, then ours (TileLang on Hopper when
`import tilelang` works, Triton), then the reference.
`api.flash_mla_with_kvcache` is the FlashMLA call signature over the same choice."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.gpu.kernels.registry import Op, always, module_on_cuda, triton_on_cuda


class MlaDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        latent_pool: torch.Tensor,
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        kv_lora_rank: int = 512,
        num_splits: int | None = None,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
        page_size: int = 1,
        q_len: int = 1,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q: [B, Hq, kv_lora_rank + rope] (q_nope already multiplied by W_UK, unit last stride); row b
        attends the slots req_to_token[rows[b], :seq_lens[b]] of latent_pool ([slots, D] or
        [slots, 1, D]; q's dtype, or e4m3 with scale 1 for kernels that upcast it): every head attends
        the same latent rows `[c | k_pe]` as keys, and their first kv_lora_rank dims as values.
        Returns out [B, Hq, kv_lora_rank] in q's dtype (`out` if given), and with `return_lse` also the
        natural-log log-sum-exp of the scaled scores [B, Hq] float32 (-inf for an empty row; its output
        is 0). `page_size` > 1: `req_to_token` is a page table instead, token pos of row r in slot
        `req_to_token[r, pos // page_size] * page_size + pos % page_size` (kernels read whole pages).
        `num_splits`: KV splits per row; None: the kernel chooses on the host (no device sync); pass a
        fixed one under CUDA graphs. The reference and FlashMLA (its own scheduler) ignore it.
        `q_len` > 1 (verify steps): q holds q_len tokens per row, q[b * q_len + i] at position
        seq_lens[b] - q_len + i, each attending the keys up to its own position; out and lse likewise."""
        ...


MLA_DECODE = Op("mla_decode", MlaDecode)
MLA_DECODE.register(
    "flash_mla", "runtime.gpu.kernels.mla_decode.flash_mla:mla_decode", module_on_cuda("flash_mla")
)


def _tilelang_on_hopper(device) -> bool:
    from runtime.gpu.kernels.mla_decode import tilelang  # light: tilelang itself is imported by the check

    return tilelang.available(device)


MLA_DECODE.register("tilelang", "runtime.gpu.kernels.mla_decode.tilelang:mla_decode", _tilelang_on_hopper)
MLA_DECODE.register("triton", "runtime.gpu.kernels.mla_decode.triton:mla_decode", triton_on_cuda)
MLA_DECODE.register("reference", "runtime.gpu.kernels.mla_decode.reference:mla_decode", always)

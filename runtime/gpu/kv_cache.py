"""The paged KV pool: per layer, K and V of every token slot. Slot 0 is padding and never attended.

The pool may be stored in float8 e4m3 (`--kv-cache-dtype fp8_e4m3`) with scale 1.0, as SGLang and vLLM
do without calibrated scales: half the bytes per token, which is what long-context decode reads; the
attention kernels upcast what they load to the query's dtype. The same holds for the MLA latent pool
(DeepSeek-V2/V3)."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loc] = k.to(self.k[layer].dtype)
        self.v[layer][loc] = v.to(self.v[layer].dtype)


class LatentKVCache:
    """The MLA pool (DeepSeek V2/V3): per layer and token slot one "head" of `kv_lora_rank` latent
    values followed by the `qk_rope_head_dim` roped shared key, the layout FlashMLA-style kernels read
    (576 values per token at full size). Keys are the whole row, values its first `kv_lora_rank`. In
    e4m3 (scale 1) the readers upcast the rows they load."""

    def __init__(
        self, num_layers: int, num_slots: int, latent_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.kv = [
            torch.zeros((num_slots, 1, latent_dim), dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * latent_dim * torch.empty((), dtype=dtype).element_size()

    def store(self, layer: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer][loc] = latent.to(self.kv[layer].dtype)

"""The MLA pool (DeepSeek V2/V3): per layer and token slot one "head" of `kv_lora_rank` latent values
followed by the `qk_rope_head_dim` roped shared key, the layout FlashMLA-style kernels read (576 values
per token at full size). Keys are the whole row, values its first `kv_lora_rank`. In e4m3 (scale 1) the
readers upcast the rows they load. No per-request state: everything is paged."""

from __future__ import annotations

import torch

from runtime.gpu.kv_pool import KVPool, SlotTensor, dtype_bytes, zeroed


class LatentKVPool(KVPool):
    def __init__(
        self, num_layers: int, num_slots: int, latent_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.kv = [zeroed((num_slots, 1, latent_dim), dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self._bytes = self.bytes_for(num_layers, latent_dim, dtype)

    @staticmethod
    def bytes_for(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return num_layers * latent_dim * dtype_bytes(dtype)

    @property
    def bytes_per_token(self) -> int:
        return self._bytes

    def slot_tensors(self) -> list[SlotTensor]:
        return [SlotTensor(f"latent.{i}", t) for i, t in enumerate(self.kv)]

    def store(self, layer: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer][loc] = latent.to(self.kv[layer].dtype)

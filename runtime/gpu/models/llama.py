"""Llama (2, 3, 3.1+, SmolLM2, ...): pre-norm decoder, RoPE, grouped-query attention, SwiGLU MLP.

Caching and batching live in the attention backend (`batch.attn_backend`); a layer here is just the
sequence of its sublayers, applied to the flattened tokens of a step."""

from __future__ import annotations

import torch
from torch import nn

from runtime.gpu.attention.base import Rope
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels import registry
from runtime.gpu.layers import MergedLinear, RMSNorm, RotaryEmbedding


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = MergedLinear(config.hidden_size, [q, kv, kv], ["q_proj", "k_proj", "v_proj"], bias)
        self.o_proj = nn.Linear(q, config.hidden_size, bias=bias)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rope = Rope(positions, self.rotary.cos, self.rotary.sin)  # applied as k is stored (one kernel)
        o = batch.attn_backend.forward(self.layer_id, q, k, v, batch, rope)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        inter, bias = config.intermediate_size, getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], ["gate_proj", "up_proj"], bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(registry.get("silu_and_mul", x.device)(gate, up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (None before the first layer); the
        add is fused into the norm that follows it. Returns (this layer's MLP output, residual)."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One table for all layers; excluded from the state dict (it is derived, not learned).
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, batch)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head when the config says so (again after moving devices)."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every token, [T, hidden]."""
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

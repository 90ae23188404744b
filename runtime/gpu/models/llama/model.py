"""Llama (2, 3, 3.1+, SmolLM2, ...): pre-norm decoder, RoPE, grouped-query attention, SwiGLU MLP.

Caching and batching live in the attention backend (`attn`, an `MHABackend`); a layer here is just the
sequence of its sublayers, applied to the flattened tokens of a step.

Folded norms (`LlamaForCausalLM.fold_norms`, done after loading when no projection has a bias): an
RMSNorm's gain g is folded into the projection that reads it (W' = W diag(g)), so
proj(norm(h)) = proj'(h) / rms(h) per token. The projection then reads the residual stream h directly,
the 1 / rms is applied by the kernel that consumes its output (RoPE + KV store for q/k/v, SwiGLU for
gate/up), and the residual add is the output projection's GEMM accumulating into h (beta = 1). Each
layer drops its two norm launches and two adds: at batch 1 on an H200 the norm kernels alone were 0.14
of 4.55 ms per Llama-8B step."""

from __future__ import annotations

import torch
from torch import nn

from runtime.engram.layer import engram_layer
from runtime.gpu import distributed
from runtime.gpu.attention import get_attention_backend
from runtime.gpu.attention.base import MHABackend, Rope
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.silu_and_mul import SILU_AND_MUL
from runtime.gpu.kv_pool import KVPoolSpec, MHAKVPool
from runtime.gpu.layers import MergedLinear, RMSNorm, RotaryEmbedding
from runtime.gpu.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_split,
    split,
)
from runtime.gpu.models.base import CausalLM, ModelAbilities

# Steps up to this many tokens take the folded path; bigger ones (prefill chunks) run the norm kernels,
# which on folded weights are unit-gain norms (fold_norms sets the gains to one), so both paths compute
# the same function. Measured on the H200 (docs/PERF.md), A/B interleaved: batch-1 decode 4.53 -> 4.45
# ms folded, but an 8K-token prefill 1.5% slower (the SwiGLU and RoPE kernels re-read h per token).
FOLDED_MAX_TOKENS = 512


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def local_heads(config) -> tuple[int, int, int, int]:
    """(q_start, q_heads, kv_start, kv_heads) this tensor-parallel rank attends with."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    tp = distributed.tp()
    return head_split(heads, kv_heads, tp.size, tp.rank)


class LlamaAttention(nn.Module):
    """Under tensor parallelism a rank holds whole KV groups (`head_split`): its slice of q/k/v
    (column-parallel) and of o_proj's input (row-parallel, summed over the group)."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        q_start, self.num_heads, kv_start, self.num_kv_heads = local_heads(config)
        self.head_dim = hd = head_dim_of(config)
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        bias = getattr(config, "attention_bias", False)
        starts = [q_start * hd, kv_start * hd, kv_start * hd] if distributed.tp().size > 1 else None
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q, kv, kv], ["q_proj", "k_proj", "v_proj"], bias, starts
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * hd, config.hidden_size, bias, (q_start * hd, q)
        )
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: MHABackend
    ) -> torch.Tensor:
        return self.o_proj(self._attend(x, positions, batch, attn, None, 0.0))

    def forward_folded(
        self, h: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: MHABackend, eps: float
    ) -> None:
        """h += o_proj(attention(norm(h))), the norm folded into qkv_proj (module docstring)."""
        h.addmm_(self._attend(h, positions, batch, attn, h, eps), self.o_proj.weight.t())

    def _attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: MHABackend,
        rms_x: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # applied as k is stored (one kernel), with the folded norm's scale when rms_x is given
        rope = Rope(positions, self.rotary.cos, self.rotary.sin, rms_x, eps)
        o = attn.forward(self.layer_id, q, k, v, batch, rope)
        return o.reshape(-1, self.num_heads * self.head_dim)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config) -> None:
        super().__init__()
        bias, tp = getattr(config, "mlp_bias", False), distributed.tp()
        start, inter = split(config.intermediate_size, tp.size, tp.rank)
        starts = [start, start] if tp.size > 1 else None
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [inter, inter], ["gate_proj", "up_proj"], bias, starts
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, (start, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(SILU_AND_MUL.get(x.device)(gate, up))

    def forward_folded(self, h: torch.Tensor, eps: float) -> None:
        """h += mlp(norm(h)), the norm folded into gate_up_proj (module docstring)."""
        gate, up = self.gate_up_proj(h)
        act = SILU_AND_MUL.get(h.device)(gate, up, h, eps)
        h.addmm_(act, self.down_proj.weight.t())


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.engram = engram_layer(config, layer_id, config.hidden_size)  # None without Engram

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: MHABackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (None before the first layer); the
        add is fused into the norm that follows it. Returns (this layer's MLP output, residual)."""
        if self.engram is not None:  # Engram adds to the residual stream before attention
            x = x if residual is None else x + residual
            x, residual = x + self.engram(x, batch), None
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, batch, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_folded(
        self, h: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: MHABackend
    ) -> None:
        """The same layer on folded weights: updates the residual stream h in place."""
        if self.engram is not None:
            h.add_(self.engram(h, batch))
        self.self_attn.forward_folded(h, positions, batch, attn, self.input_layernorm.eps)
        self.mlp.forward_folded(h, self.post_attention_layernorm.eps)

    def can_fold_norms(self) -> bool:
        """Folding scales a projection's output per token, which would scale a bias too; the residual
        add moves into the output projections' GEMMs, which have no bias slot there."""
        projs = (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        return all(p.bias is None for p in projs)

    @torch.no_grad()
    def fold_norms(self) -> None:
        for norm, proj in ((self.input_layernorm, self.self_attn.qkv_proj),
                           (self.post_attention_layernorm, self.mlp.gate_up_proj)):  # fmt: skip
            # in float32, one rounding to the weight's dtype
            proj.weight.copy_(proj.weight.float() * norm.weight.float()[None, :])
            norm.weight.fill_(1.0)  # the gain now lives in the weight: big steps run a unit-gain norm


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One table for all layers; excluded from the state dict (it is derived, not learned).
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norms_folded = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: MHABackend
    ) -> torch.Tensor:
        if self.norms_folded and input_ids.shape[0] <= FOLDED_MAX_TOKENS:
            h = self.embed_tokens(input_ids)  # a fresh tensor: the layers update it in place
            for i, layer in enumerate(self.layers):
                layer.forward_folded(h, positions, batch, attn)
                if batch.tapped(i):
                    batch.taps[i] = h.clone()
            return self.norm(h)
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, batch, attn)
            if batch.tapped(i):
                batch.taps[i] = x + residual
        return self.norm(x, residual)[0]


class LlamaForCausalLM(CausalLM):
    abilities = ModelAbilities(fp8_kv_cache=True)

    def __init__(self, config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def prepare_for_serving(self) -> None:
        """Fold each layer's two RMSNorm gains into the projections after them (module docstring), once;
        nothing when a projection has a bias, or under tensor parallelism (the folded path adds each rank's
        partial output projection into the residual in place, before any all-reduce could sum them)."""
        model = self.model
        if model.norms_folded or not all(layer.can_fold_norms() for layer in model.layers):
            return
        if distributed.tp().size > 1:
            return
        for layer in model.layers:
            layer.fold_norms()
        model.norms_folded = True

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: MHABackend
    ) -> torch.Tensor:
        return self.model(input_ids, positions, batch, attn)

    @property
    def logits_dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens to float32 where it computes, and a greedy argmax
        does not need to (widening keeps the order). At B=256 that saves a 130 MB copy a step."""
        return self.lm_head(hidden)

    # ------------------------------------------------------------------ KV layout and attention

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        c = self.config
        return MHAKVPool.bytes_for(c.num_hidden_layers, self.num_kv_heads, head_dim_of(c), dtype)

    def make_kv_pool(self, spec: KVPoolSpec) -> MHAKVPool:
        c = self.config
        return MHAKVPool(
            c.num_hidden_layers, spec.num_slots, self.num_kv_heads, head_dim_of(c), spec.dtype, spec.device
        )

    def make_attention_backend(self, name: str, page_size: int) -> MHABackend:
        hd = head_dim_of(self.config)
        attn = self.model.layers[0].self_attn
        backend = get_attention_backend(name)(attn.num_heads, self.num_kv_heads, hd, hd**-0.5)
        backend.page_size = page_size
        return backend

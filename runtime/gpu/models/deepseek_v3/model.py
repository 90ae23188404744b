"""DeepSeek-V3 / R1: multi-head latent attention (MLA), DeepSeekMoE, multi-token-prediction (MTP) layers.
Also DeepSeek-V2 / V2-Lite / V2.5 (`DeepseekV2ForCausalLM`): the same model without MTP layers; its
routing (softmax, "greedy" or "group_limited_greedy", no correction bias) is read from the config by
`TopkRouter`, and its complex-number rope is V3's interleaved rope (V2 configs have no `rope_interleave`).

Exact against transformers' `deepseek_v3` and `deepseek_v2` (tests/unit/gpu/test_deepseek_v3_parity.py,
test_deepseek_v2_parity.py). A layer is `x + MLA(norm(x))`, then `x + FFN(norm(x))` where the FFN is a
dense SwiGLU for the first `first_k_dense_replace` layers and DeepSeekMoE after. How MLA attends over the
paged latent pool (`kv_pool.py`; expanded for prefill, absorbed for decode) lives in the attention backend
(`attention_ref.py`, the reference; `attention_kernel.py`, decode through the `mla_decode` op).
The routed experts run the `fused_moe` op. On CUDA neither reads the device on the host, so decode
steps run as CUDA graphs.

FP8 weights (`fp8_weights`, from `--quantization`): the projections DeepSeek's checkpoints store in FP8
128 x 128 blocks (q/kv down and up, o, the dense and shared-expert MLPs, the routed experts) stay FP8
and run FP8 GEMMs (`layers/fp8_linear.py`); a float checkpoint or dummy weights are quantized at load.
`kv_b_proj` is dequantized anyway (MLA reads it as W_UK / W_UV); the router, norms, embedding and head
stay in the model dtype. Without the flag FP8 checkpoints are dequantized on load.

MTP layers are `model.layers.{num_hidden_layers + i}` in checkpoints (weights.py); they are loaded when present and
run through `mtp_forward` by the MTP drafter (runtime/speculative/mtp.py), over a pool of their own
(`make_mtp_kv_pool`)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import structlog
import torch
from torch import nn

from runtime.gpu import distributed
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.fused_moe import FUSED_MOE
from runtime.gpu.kernels.silu_and_mul import SILU_AND_MUL
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.layers import MergedLinear, RMSNorm, RotaryEmbedding, expert_parallel
from runtime.gpu.layers.fp8_linear import MergedFp8Linear, linear
from runtime.gpu.layers.moe import RoutedExperts, TopkRouter
from runtime.gpu.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    split,
)
from runtime.gpu.layers.rotary import rope_parameters
from runtime.gpu.models.base import CausalLM, ModelAbilities
from runtime.gpu.models.deepseek_v3.attention_kernel import MLAKernelBackend
from runtime.gpu.models.deepseek_v3.attention_ref import TorchMLABackend
from runtime.gpu.models.deepseek_v3.kv_pool import LatentKVPool
from runtime.gpu.models.deepseek_v3.weights import load_deepseek_checkpoint, skips_tensor
from runtime.gpu.quant import fp8

log = structlog.get_logger(__name__)


def softmax_scale(config) -> float:
    """1/sqrt(d_qk), times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers and DeepSeek do)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    p = rope_parameters(config)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        factor = p["factor"]
        mscale = 0.1 * p["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _column(
    in_features: int, out_features: int, rows: tuple[int, int], fp8_weights: bool = False
) -> nn.Module:
    """A projection whose output features split over the TP ranks (whole on one rank)."""
    if distributed.tp().size == 1:
        return linear(in_features, out_features, fp8_weights=fp8_weights)
    return ColumnParallelLinear(in_features, out_features, False, rows)


def _row(
    in_features: int, out_features: int, bias: bool, cols: tuple[int, int], fp8_weights: bool
) -> nn.Module:
    """A projection whose input features split over the TP ranks, summed by all-reduce."""
    if distributed.tp().size == 1:
        return linear(in_features, out_features, bias, fp8_weights)
    return RowParallelLinear(in_features, out_features, bias, cols)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3)... -> [x0, x2, ... | x1, x3, ...]: interleaved RoPE becomes rotate-half.
    q and k get the same permutation, so their dot products (all attention sees) are unchanged."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _check_tp(fp8_weights: bool) -> None:
    if fp8_weights and distributed.tp().size > 1:
        raise ValueError("FP8 weights under tensor parallelism are not supported yet (--quantization none)")


class DeepseekV3Attention(nn.Module):
    """MLA: q from a low-rank (or direct) projection; one latent c and one roped key k_pe per token.
    Under tensor parallelism a rank holds a share of the heads (`split`): their rows of q_b_proj (or
    q_proj) and kv_b_proj, their columns of o_proj (row-parallel); the latent projection is whole."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, fp8_weights: bool = False) -> None:
        super().__init__()
        _check_tp(fp8_weights)
        tp = distributed.tp()
        self.layer_id = layer_id
        h_start, self.num_heads = split(config.num_attention_heads, tp.size, tp.rank)
        heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.interleave = getattr(config, "rope_interleave", True)
        hidden, qk_dim = config.hidden_size, self.nope_dim + self.rope_dim
        bias = getattr(config, "attention_bias", False)
        self.q_lora_rank = config.q_lora_rank
        f8 = fp8_weights
        q_rows = (h_start * qk_dim, self.num_heads * qk_dim)
        if self.q_lora_rank is None:
            self.q_proj = _column(hidden, heads * qk_dim, q_rows, fp8_weights=f8)
        else:
            self.q_a_proj = linear(hidden, self.q_lora_rank, bias, f8)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # eps 1e-6 in the reference, not rms_norm_eps
            self.q_b_proj = _column(self.q_lora_rank, heads * qk_dim, q_rows, fp8_weights=f8)
        self.kv_a_proj_with_mqa = linear(hidden, self.kv_lora_rank + self.rope_dim, bias, f8)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        # always in the model dtype: MLA reads it as W_UK / W_UV (absorbed into q and the output)
        kv_dim = self.nope_dim + self.v_dim
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, heads * kv_dim, False, (h_start * kv_dim, self.num_heads * kv_dim)
        )
        o_cols = (h_start * self.v_dim, self.num_heads * self.v_dim)
        self.o_proj = _row(heads * self.v_dim, hidden, bias, o_cols, f8)
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchMLABackend
    ) -> torch.Tensor:
        q = (
            self.q_proj(x)
            if self.q_lora_rank is None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        )
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        c, k_pe = self._kv_parts(x)
        if self.interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        latent = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + dr]: what the cache holds
        w_uk, w_uv = self.up_projections()
        o = attn.forward_mla(self.layer_id, q_nope, q_pe, latent, w_uk, w_uv, batch)
        return self.o_proj(o.reshape(-1, self.num_heads * self.v_dim))

    def _kv_parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed latent c [T, r] and the unroped key k_pe [T, 1, dr] of x."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c), k_pe.unsqueeze(1)

    def kv_latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What the cache holds for x [T, D] at `positions`, [T, 1, r + dr], and nothing of the queries
        (the MTP drafter's KV-only pass, `DeepseekV3MTPLayer.store_kv`)."""
        c, k_pe = self._kv_parts(x)
        if self.interleave:
            k_pe = _deinterleave(k_pe)
        _, k_pe = self.rotary(positions, k_pe, k_pe)  # (out of place: k_pe as q too, then dropped)
        return torch.cat([c.unsqueeze(1), k_pe], dim=-1)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, r] and W_UV [H, dv, r]: views of kv_b_proj (latent -> per-head k_nope | v)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]


class DeepseekV3MLP(nn.Module):
    """SwiGLU: the dense FFN of the first layers, and the shared experts. With FP8 weights gate|up is FP8
    only when I fills whole 128-row blocks (V3's 18432 and 2048 do; V2-Lite's dense 10944 stays float)."""

    def __init__(self, hidden: int, intermediate: int, fp8_weights: bool = False) -> None:
        super().__init__()
        _check_tp(fp8_weights)
        tp = distributed.tp()
        start, inter = split(intermediate, tp.size, tp.rank)  # TP: a slice of the hidden features
        sizes, names = [inter, inter], ["gate_proj", "up_proj"]
        if fp8_weights and MergedFp8Linear.fits(sizes):
            self.gate_up_proj = MergedFp8Linear(hidden, sizes, names)
        else:
            self.gate_up_proj = MergedLinear(
                hidden, sizes, names, starts=[start, start] if tp.size > 1 else None
            )
        self.down_proj = _row(intermediate, hidden, False, (start, inter), fp8_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(SILU_AND_MUL.get(x.device)(gate, up))


class DeepseekV3MoE(nn.Module):
    """Routed experts (top-k of n_routed_experts, weighted) plus always-on shared experts."""

    def __init__(self, config, fp8_weights: bool = False) -> None:
        super().__init__()
        inter, d = config.moe_intermediate_size, config.hidden_size
        self.gate = TopkRouter(config)
        # gate|up stack their scale blocks: I in whole 128-row blocks (V3's 2048, V2-Lite's 1408)
        fp8_experts = fp8_weights and inter % fp8.BLOCK[0] == 0
        # expert parallelism: this rank holds its placement's experts; tokens travel to theirs
        self.ep = expert_parallel.for_rank(config.n_routed_experts)
        n_experts, logical = config.n_routed_experts, None
        if self.ep is not None:
            logical = self.ep.placement.local(distributed.ep().rank)
            n_experts = len(logical)
        fmt = "fp8" if fp8_experts else "float"
        self.experts = RoutedExperts(n_experts, d, inter, weight_format=fmt, logical=logical)
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = DeepseekV3MLP(d, inter * n_shared, fp8_weights) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids) if self.ep is None else self.ep(x, weights, ids, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, fp8_weights: bool = False) -> None:
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = DeepseekV3Attention(config, layer_id, rotary, fp8_weights)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        dense = layer_id < (getattr(config, "first_k_dense_replace", 0) or 0)
        self.mlp = (
            DeepseekV3MLP(d, config.intermediate_size, fp8_weights)
            if dense
            else DeepseekV3MoE(config, fp8_weights)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchMLABackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last sublayer's output, not yet added to `residual` (None before the first layer); the
        add is fused into the norm that follows it (as in Llama). Returns (this layer's FFN output,
        residual): the layer's output is their sum."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, batch, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class SharedHead(nn.Module):
    """The MTP layer's final norm; its `head` is the main model's lm_head (not stored twice)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class DeepseekV3MTPLayer(DeepseekV3DecoderLayer):
    """Predicts token t+2 from token t+1's embedding and the main model's hidden state at t:
    `h = layer(eh_proj([enorm(embed(t+1)) ; hnorm(h_t)]))`, logits = lm_head(shared_head.norm(h))."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, fp8_weights: bool = False) -> None:
        super().__init__(config, layer_id, rotary, fp8_weights)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, eps)

    def predict(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchMLABackend,
    ) -> torch.Tensor:
        x = self._input(embeds, hidden)
        return self.shared_head.norm(*super().forward(x, None, positions, batch, attn))[0]

    def store_kv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> None:
        """The layer's latents for these entries into `batch.kv_pool` (at `batch.out_loc`), and nothing
        more: no queries, attention, output projection or MoE (which `predict` runs for every entry)."""
        h = self.input_layernorm(self._input(embeds, hidden))
        batch.kv_pool.store(self.self_attn.layer_id, batch.out_loc, self.self_attn.kv_latent(h, positions))

    def _input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class DeepseekV3Model(nn.Module):
    def __init__(self, config, max_positions: int, fp8_weights: bool = False) -> None:
        super().__init__()
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_positions)
        n_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        layers = [DeepseekV3DecoderLayer(config, i, rotary, fp8_weights) for i in range(self.num_layers)]
        layers += [DeepseekV3MTPLayer(config, self.num_layers + i, rotary, fp8_weights) for i in range(n_mtp)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchMLABackend
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers[: self.num_layers]):
            x, residual = layer(x, residual, positions, batch, attn)
            if batch.tapped(i):
                batch.taps[i] = x + residual
        return self.norm(x, residual)[0]


class DeepseekV3ForCausalLM(CausalLM):
    # fp8_weights: the runner passes fp8_weights=True under --quantization fp8 / auto; fp8 KV: an e4m3
    # latent pool (scale 1), read upcast
    abilities = ModelAbilities(fp8_kv_cache=True, fp8_weights=True)

    def __init__(self, config, max_positions: int | None = None, fp8_weights: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fp8_weights = fp8_weights
        self.model = DeepseekV3Model(config, max_positions or config.max_position_embeddings, fp8_weights)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    @property
    def mtp_layers(self) -> list[DeepseekV3MTPLayer]:
        return list(self.model.layers[self.model.num_layers :])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchMLABackend
    ) -> torch.Tensor:
        return self.model(input_ids, positions, batch, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchMLABackend,
    ) -> torch.Tensor:
        """MTP layer k on the hidden states `hidden` [T, D] (pre-norm output of the previous stage) and
        the next tokens `next_ids` [T]; returns its normed hidden states (logits: `compute_logits`)."""
        embeds = self.model.embed_tokens(next_ids)
        return self.mtp_layers[k].predict(embeds, hidden, positions, batch, attn)

    def mtp_store_kv(
        self,
        k: int,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchMLABackend,
    ) -> None:
        self.mtp_layers[k].store_kv(self.model.embed_tokens(next_ids), hidden, positions, batch)

    # ------------------------------------------------------------------ KV layout and attention

    def _latent_dim(self) -> int:
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return LatentKVPool.bytes_for(len(self.model.layers), self._latent_dim(), dtype)

    def make_kv_pool(self, spec: KVPoolSpec) -> LatentKVPool:
        return LatentKVPool(
            len(self.model.layers), spec.num_slots, self._latent_dim(), spec.dtype, spec.device
        )

    def make_mtp_kv_pool(self, spec: KVPoolSpec) -> LatentKVPool:
        """The MTP drafter's pool: the MTP layers' latents only (the main layers' entries are empty)."""
        n_main, dim = self.model.num_layers, self._latent_dim()
        pool = LatentKVPool(len(self.mtp_layers), spec.num_slots, dim, spec.dtype, spec.device)
        pool.kv = [torch.empty(0, 1, dim, dtype=spec.dtype, device=spec.device)] * n_main + pool.kv
        return pool

    def make_attention_backend(self, name: str, page_size: int) -> TorchMLABackend:
        """Backend "torch": the PyTorch reference (SDPA) everywhere. Any other ("triton", the CUDA default):
        decode rows through the `mla_decode` op (FlashMLA / Triton on CUDA, the reference elsewhere)."""
        c = self.config
        cls = TorchMLABackend if name == "torch" else MLAKernelBackend
        backend = cls(
            self.model.layers[0].self_attn.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, softmax_scale(c),
            qk_nope_dim=c.qk_nope_head_dim, v_dim=c.v_head_dim,
        )  # fmt: skip
        backend.page_size = page_size
        device = self.lm_head.weight.device
        if device.type == "cuda" and FUSED_MOE.select(device).name == "reference":
            # the reference MoE reads expert counts on the host: a decode step cannot be captured
            log.info("fused_moe is the reference: decode runs without CUDA graphs")
            backend.supports_cuda_graph = False
        return backend

    # ------------------------------------------------------------------ weights

    def load_weights(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        load_deepseek_checkpoint(self, tensors)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return skips_tensor(self, name)

    def idle_forward(self) -> None:
        """A DP rank with no tokens this step still joins every MoE layer's exchange, in layer order."""
        c = self.config
        empty = torch.empty(
            0, c.hidden_size, dtype=self.lm_head.weight.dtype, device=self.lm_head.weight.device
        )
        for layer in self.model.layers[: self.model.num_layers]:
            if isinstance(layer.mlp, DeepseekV3MoE):
                layer.mlp(empty)

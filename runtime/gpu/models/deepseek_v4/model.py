"""DeepSeek-V4: mHC residual streams, shared-KV MQA over a sliding window plus compressed KV (CSA / HCA),
hash-routed then learned-routed MoE with clamped SwiGLU.

Exact against transformers' `deepseek_v4` (tests/unit/gpu/test_deepseek_v4_parity.py). A layer is
`attn_hc -> input_layernorm -> attention -> mix`, then `ffn_hc -> post_attention_layernorm -> MoE -> mix`
on `hc_mult` streams (mhc.py). Attention per layer type: `sliding_attention` sees the last
`sliding_window` tokens; CSA adds 4x compressed entries picked by the Lightning Indexer; HCA adds all
128x compressed entries (compressor.py). How queries attend over the window ring and the compressed
entries, across steps, is the backend's (attention.py and attention_decode.py, state in kv_pool.py).

Loads Hugging Face names and the upstream ones (`attn.wq_a`, `ffn.experts.N.w1`, `hc_attn_fn`...), float,
FP8 or with FP4 experts (weights.py).
Weights as stored (`fp8_weights`, from `--quantization` as for V3): the projections the releases store in
FP8 128 x 128 blocks (q/kv, the grouped o_a and o_b, the shared experts, the MTP block's e/h) stay FP8
(`layers/fp8_linear.py`) and the routed experts stay packed FP4 when the config says `expert_dtype:
fp4` (else FP8 as V3's, `expert_format`), run by `fused_moe`'s FP4 kernels; a float checkpoint or dummy
weights are quantized at load. The indexer's q_b_proj (FP8 in the releases) is dequantized: it lives in
compressor.py. The router, norms, compressors, mHC, embedding and head stay in the model dtype.
The MTP block (`mtp.{i}.*`, official code only) loads as `layers.{n + i}` and runs through
`mtp_forward` (the MTP drafter, runtime/speculative/mtp.py). Checkpoints without it drop it."""

from __future__ import annotations

from collections.abc import Iterator

import structlog
import torch
from torch import nn

from runtime.engram.layer import engram_layer
from runtime.gpu import distributed
from runtime.gpu.forward_batch import ForwardBatch
from runtime.gpu.kernels.silu_and_mul import SILU_AND_MUL
from runtime.gpu.kv_pool import KVPoolSpec
from runtime.gpu.layers import MergedLinear, RMSNorm, expert_parallel
from runtime.gpu.layers.fp8_linear import Fp8GroupedLinear, MergedFp8Linear, linear
from runtime.gpu.layers.moe import HashRouter, RoutedExperts, TopkRouter
from runtime.gpu.layers.parallel import Embedding
from runtime.gpu.models.base import CausalLM, ModelAbilities
from runtime.gpu.models.deepseek_v3.weights import destination_dtype, load_named, skips_tensor
from runtime.gpu.models.deepseek_v4.attention import TorchV4Backend
from runtime.gpu.models.deepseek_v4.compressor import Compressor, Indexer
from runtime.gpu.models.deepseek_v4.kv_pool import V4KVPool
from runtime.gpu.models.deepseek_v4.mhc import HyperConnection, HyperHead
from runtime.gpu.models.deepseek_v4.rope import InterleavedRope
from runtime.gpu.models.deepseek_v4.weights import checkpoint_tensors
from runtime.gpu.quant import fp4, fp8

log = structlog.get_logger(__name__)

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: input [T, g, in/g], group i through rows [i*out/g, (i+1)*out/g)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.in_features)
        return torch.einsum("tgi,goi->tgo", x, w)


class DeepseekV4Attention(nn.Module):
    """Shared-KV MQA: q through a normed low-rank projection and a per-head unit RMS norm; one K=V head,
    roped on its last `qk_rope_head_dim` channels, so the output is rotated back before the grouped
    low-rank output projection."""

    def __init__(self, config, layer_id: int, layer_type: str, fp8_weights: bool = False) -> None:
        super().__init__()
        self.layer_id, self.layer_type = layer_id, layer_type
        self.num_heads, self.head_dim, self.eps = (
            config.num_attention_heads,
            config.head_dim,
            config.rms_norm_eps,
        )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.rope = InterleavedRope(config, "main" if self.layer_type == "sliding_attention" else "compress")
        f8 = fp8_weights
        self.q_a_proj = linear(hidden, config.q_lora_rank, fp8_weights=f8)
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = linear(config.q_lora_rank, self.num_heads * self.head_dim, fp8_weights=f8)
        self.kv_proj = linear(hidden, self.head_dim, fp8_weights=f8)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.o_groups = config.o_groups
        per_group = self.num_heads * self.head_dim // config.o_groups
        o_rows = config.o_groups * config.o_lora_rank
        o_a = Fp8GroupedLinear if f8 and Fp8GroupedLinear.fits(o_rows, config.o_groups) else GroupedLinear
        self.o_a_proj = o_a(per_group, o_rows, config.o_groups)
        self.o_b_proj = linear(o_rows, hidden, fp8_weights=f8)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if self.layer_type in (CSA, HCA):
            csa = self.layer_type == CSA
            rate = config.compress_rates[self.layer_type]
            self.compressor = Compressor(hidden, self.head_dim, rate, overlap=csa, eps=eps)
            if csa:
                self.compressor.indexer = Indexer(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchV4Backend
    ) -> torch.Tensor:
        qr = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(qr).view(-1, self.num_heads, self.head_dim)
        q = self.rope(q, positions, unit_rms_eps=self.eps)  # the per-head unit RMS norm first
        kv = self.rope(self.kv_norm(self.kv_proj(x)), positions)
        o = attn.forward_v4(self, q, kv, x, qr, batch)
        o = self.rope(o, positions, inverse=True)
        return self.o_b_proj(
            self.o_a_proj(o.reshape(-1, self.o_groups, o.shape[1] * o.shape[2] // self.o_groups)).flatten(1)
        )


class DeepseekV4MLP(nn.Module):
    """The shared expert: SwiGLU with V4's clamp."""

    def __init__(
        self, hidden: int, intermediate: int, limit: float | None, fp8_weights: bool = False
    ) -> None:
        super().__init__()
        sizes, names = [intermediate, intermediate], ["gate_proj", "up_proj"]
        merged = MergedFp8Linear if fp8_weights and MergedFp8Linear.fits(sizes) else MergedLinear
        self.gate_up_proj = merged(hidden, sizes, names)
        self.down_proj = linear(intermediate, hidden, fp8_weights=fp8_weights)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(SILU_AND_MUL.get(x.device)(gate, up, limit=self.limit))


class DeepseekV4MoE(nn.Module):
    """Routed experts (hash-routed by token id in `hash_moe` layers, else top-k of sqrt-softplus scores
    plus correction bias) plus the shared expert."""

    def __init__(self, config, hashed: bool, fp8_weights: bool = False) -> None:
        super().__init__()
        self.hashed = hashed
        self.gate = HashRouter(config) if self.hashed else TopkRouter(config)
        limit, inter = config.swiglu_limit, config.moe_intermediate_size
        # expert parallelism: this rank holds its placement's experts; tokens travel to theirs
        self.ep = expert_parallel.for_rank(config.n_routed_experts)
        logical = self.ep.placement.local(distributed.ep().rank) if self.ep is not None else None
        n_experts = len(logical) if logical is not None else config.n_routed_experts
        fmt = expert_format(config, fp8_weights)
        self.experts = RoutedExperts(n_experts, config.hidden_size, inter, limit, fmt, logical=logical)
        shared = inter * (config.n_shared_experts or 1)
        self.shared_experts = DeepseekV4MLP(config.hidden_size, shared, limit, fp8_weights)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids) if self.hashed else self.gate(x)
        routed = self.experts(x, weights, ids) if self.ep is None else self.ep(x, weights, ids, self.experts)
        return routed + self.shared_experts(x)


def expert_format(config, fp8_weights: bool) -> str:
    """The routed experts' `RoutedExperts.weight_format` when the model keeps weights as stored: FP4 when
    the checkpoint stores them so (V4-Flash's `expert_dtype: fp4`), else V3's FP8 where I fills whole
    128-row blocks; float without `fp8_weights`."""
    if not fp8_weights:
        return "float"
    if getattr(config, "expert_dtype", None) == "fp4":
        return "fp4"
    return "fp8" if config.moe_intermediate_size % fp8.BLOCK[0] == 0 else "float"


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        layer_type: str | None = None,
        mlp_type: str | None = None,
        fp8_weights: bool = False,
    ) -> None:
        super().__init__()
        layer_type = layer_type or config.layer_types[layer_id]
        mlp_type = mlp_type or config.mlp_layer_types[layer_id]
        hc = (
            config.hc_mult,
            config.hidden_size,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DeepseekV4Attention(config, layer_id, layer_type, fp8_weights)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DeepseekV4MoE(config, mlp_type == "hash_moe", fp8_weights)
        self.engram = engram_layer(config, layer_id, config.hidden_size, config.hc_mult)  # None without

    def forward(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchV4Backend,
    ) -> torch.Tensor:
        """h: the residual streams [T, hc_mult, D]."""
        if self.engram is not None:  # Engram (V4.1): gated per stream, added before attention
            h = h + self.engram(h, batch)
        x, post, comb = self.attn_hc(h, norm=self.input_layernorm)  # x comes out normed
        h = HyperConnection.merge(h, self.self_attn(x, positions, batch, attn), post, comb)
        x, post, comb = self.ffn_hc(h, norm=self.post_attention_layernorm)
        return HyperConnection.merge(h, self.mlp(x, input_ids), post, comb)


class DeepseekV4MTPBlock(DeepseekV4DecoderLayer):
    """Multi-token prediction (official code; transformers drops it): a sliding-window V4 block on
    `e_proj(enorm(embed(t+1))) + h_proj(hnorm(h_t))` per stream, with its own hyper-head and norm;
    the embedding and lm_head are the main model's."""

    def __init__(self, config, layer_id: int, fp8_weights: bool = False) -> None:
        super().__init__(config, layer_id, "sliding_attention", "moe", fp8_weights)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.e_proj = linear(d, d, fp8_weights=fp8_weights)
        self.h_proj = linear(d, d, fp8_weights=fp8_weights)
        self.hc_head = HyperHead(config.hc_mult, d, config.hc_eps, eps)
        self.norm = RMSNorm(d, eps)

    def predict(
        self,
        embeds: torch.Tensor,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchV4Backend,
    ) -> torch.Tensor:
        """embeds [T, D] of the next tokens, streams [T, n, D] of the main model's last layer -> [T, D]."""
        h = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return self.norm(self.hc_head(super().forward(h, input_ids, positions, batch, attn)))


class DeepseekV4Model(nn.Module):
    def __init__(self, config, fp8_weights: bool = False) -> None:
        super().__init__()
        self.hc_mult, self.num_layers = config.hc_mult, config.num_hidden_layers
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        n_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        layers = [DeepseekV4DecoderLayer(config, i, fp8_weights=fp8_weights) for i in range(self.num_layers)]
        layers += [DeepseekV4MTPBlock(config, self.num_layers + i, fp8_weights) for i in range(n_mtp)]
        self.layers = nn.ModuleList(layers)  # MTP blocks last, as `layers.{n + i}`
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.window, self.replay_from = config.sliding_window, replay_start(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchV4Backend
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        skipped = None
        for i, layer in enumerate(self.layers[: self.num_layers]):
            if i == self.replay_from and max(batch.extend_lens, default=0) > self.window:
                # decoder bounded replay: the trailing sliding-only layers see each row's last `window`
                # new tokens; the others keep their streams from here (their logits are never sampled)
                batch, idx = attn.narrow(batch, [min(n, self.window) for n in batch.extend_lens])
                skipped, h, input_ids, positions = h, h[idx], input_ids[idx], positions[idx]
            h = layer(h, input_ids, positions, batch, attn)
            if batch.tapped(i):  # (a cut batch shares the step's taps)
                # the streams [T, n, D]; after a bounded-replay cut, the cut tokens keep their streams
                # from before it (drafter features of tokens no sampled logit depends on)
                batch.taps[i] = h if skipped is None else skipped.index_copy(0, idx, h)
        if skipped is not None:
            h = skipped.index_copy(0, idx, h)
        return self.norm(self.hc_head(h))


def replay_start(config) -> int | None:
    """First layer of the decoder-side bounded replay (opt-in: config `decoder_bounded_replay`, see
    docs/deepseek_v4.md): the sliding-only layers after the last CSA / HCA layer. None when off, or
    when no such layers exist (V4-Flash ends on CSA) or no layer compresses (the replay would then
    forget everything before the window)."""
    if not getattr(config, "decoder_bounded_replay", False):
        return None
    types = config.layer_types[: config.num_hidden_layers]
    compressed = [i for i, t in enumerate(types) if t != "sliding_attention"]
    if not compressed or compressed[-1] == len(types) - 1:
        log.warning("decoder_bounded_replay_off", reason="no sliding-only layers after a compressed one")
        return None
    first = compressed[-1] + 1
    log.info("decoder_bounded_replay", layers=f"{first}..{len(types) - 1}", window=config.sliding_window)
    return first


class DeepseekV4ForCausalLM(CausalLM):
    # Prefix-cache hits reuse the paged compressed entries and indexer keys; the sliding-window ring and
    # compressor tails are rebuilt by replaying the tokens before the hit (kv_pool.py, StepPlan.replay).
    # The sliding-window ring and compressor tails hold positions in place: rejected drafts cannot be
    # dropped yet (V4KVPool.truncate), so no speculative decoding.
    # fp8_weights: the runner passes fp8_weights=True under --quantization fp8 / auto (weights as stored)
    abilities = ModelAbilities(prefix_cache=True, fp8_weights=True)

    def __init__(self, config, max_positions: int | None = None, fp8_weights: bool = False) -> None:
        super().__init__()
        if distributed.tp().size > 1:
            raise ValueError(
                "DeepSeek-V4 is not split by tensor parallelism yet: serve it with --enable-dp-attention "
                "--dp-size N --ep-size N (each rank its own attention, experts split)"
            )
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.model = DeepseekV4Model(config, fp8_weights)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def attention_layers(self) -> list[DeepseekV4Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, attn: TorchV4Backend
    ) -> torch.Tensor:
        return self.model(input_ids, positions, batch, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ KV layout and attention

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return V4KVPool.bytes_for(self.config, dtype)

    def kv_bytes_per_row(self, dtype: torch.dtype) -> int:
        return V4KVPool.bytes_per_row(self.config, dtype)

    def make_kv_pool(self, spec: KVPoolSpec) -> V4KVPool:
        """Per-row state is allocated for every request row of `spec` up front."""
        return V4KVPool(self.config, self.attention_layers(), spec)

    def make_attention_backend(self, name: str, page_size: int) -> TorchV4Backend:
        if name not in ("torch", "auto"):
            log.info("no V4 attention kernels yet; using the PyTorch reference", requested=name)
        c = self.config
        backend = TorchV4Backend(c.num_attention_heads, c.head_dim, c.sliding_window)
        backend.page_size = page_size
        return backend

    # ------------------------------------------------------------------ weights

    def load_weights(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face or upstream DeepSeek names, float or FP8/FP4 (weights.py); quantized weights stay
        as stored where their module keeps that format."""
        dtype_of = destination_dtype(self)

        def keep(name: str, weight: torch.Tensor) -> bool:
            return dtype_of(name) == (fp4.PACKED if fp4.is_packed(weight) else weight.dtype)

        load_named(self, checkpoint_tensors(tensors, self.config, self.model.num_layers, keep))

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return skips_tensor(self, name)

    def prepare_for_serving(self) -> None:
        """FP4 routed experts into the tiled form the GPU kernels stream (`RoutedExperts.tile_fp4`)."""
        for m in self.modules():
            if isinstance(m, RoutedExperts):
                m.tile_fp4()

    def idle_forward(self) -> None:
        """A DP rank with no tokens this step still joins every MoE layer's exchange, in layer order."""
        w = self.lm_head.weight
        empty = torch.empty(0, self.config.hidden_size, dtype=w.dtype, device=w.device)
        no_ids = torch.empty(0, dtype=torch.int64, device=w.device)
        for layer in self.model.layers[: self.model.num_layers]:
            layer.mlp(empty, no_ids)

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights, and hash-routing tables with k distinct experts per token id from a random start
        (all zeros would send every token of the hash layers to expert 0)."""
        super().init_dummy_weights(seed)
        g = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, HashRouter):
                vocab, k = m.tid2eid.shape
                start = torch.randint(0, m.num_experts, (vocab, 1), generator=g)
                m.tid2eid.data.copy_((start + torch.arange(k)) % m.num_experts)

    @property
    def mtp_layers(self) -> list[DeepseekV4MTPBlock]:
        return list(self.model.layers[self.model.num_layers :])

    @property
    def mtp_hidden_tap(self) -> int:
        """The layer whose output the MTP block reads: the last one's streams, before the hyper-head."""
        return self.model.num_layers - 1

    def make_mtp_kv_pool(self, spec: KVPoolSpec) -> V4KVPool:
        """The MTP drafter's pool: the MTP blocks' sliding-window rings (per row; nothing paged)."""
        return V4KVPool(self.config, [layer.self_attn for layer in self.mtp_layers], spec)

    def mtp_forward(
        self,
        k: int,
        next_ids: torch.Tensor,
        streams: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        attn: TorchV4Backend,
    ) -> torch.Tensor:
        """MTP block k on the main model's last streams [T, n, D] (before the hyper-head) and the next
        tokens [T]; its normed hidden states (logits: `compute_logits`); the MTP drafter's step."""
        embeds = self.model.embed_tokens(next_ids)
        return self.mtp_layers[k].predict(embeds, streams, next_ids, positions, batch, attn)

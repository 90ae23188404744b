"""DSpark's block drafter (Peking University and DeepSeek-AI; DeepSpec's `dspark`): one parallel pass
drafts a whole block from the target's own features, a Markov head links the block's tokens, and a
confidence head tells the draft-length policy how far the block is worth verifying.

- Context: the outputs of chosen target layers (`target_layer_ids`) at every position the target
  computes, concatenated, through `fc` and an RMSNorm: H_ctx. Each draft layer projects H_ctx to its own
  keys and values (RoPE at the context position). They depend on the position's prefix only, so they are
  kept per KV slot of the target (`capture`, after each target forward), like a KV cache.
- Block: [anchor = the row's last token, mask x (K - 1)] at positions anchor_pos + 0..K-1, through the
  draft layers; each block entry attends to the context of positions before the anchor (the last
  `window` of them: sliding attention, as the DSpark stages of DeepSeek-V4-Flash-0731) and to the whole
  block, both directions. Entry j's output h_j gives base logits U_j through the target's (shared) head.
- Markov head, left to right: logits_j = U_j + W2 W1[x_{j-1}] (rank `markov_rank`; x_{-1} the anchor),
  the draft d_{j+1} = argmax; confidence c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b), the estimate that
  d_{j+1} is accepted given the ones before, which the scheduler's policy multiplies out.

Everything runs on the device right after a step (`observe`): the rows' lengths are on the device
(`TokenHistory`), the context window has a fixed width, so the drafts and their confidence are ready with
the step's tokens and the scheduler plans the next step's draft lengths from them.

Weights: the checkpoint's `mtp.*` tensors when it has them, in this module's layout (`mtp.fc.weight`,
`mtp.layers.{i}.self_attn.q_proj.weight`, ..., `mtp.markov_w1.weight`, `mtp.markov_w2.weight`,
`mtp.confidence.weight`; the number of layers is read from the names); otherwise a seeded random
initialisation (the drafts are then poor, and the policy switches speculation off where they fail).
The embedding and the head are the target's."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from runtime.gpu.forward_batch import ForwardBatch, GraphStep, StepTables
from runtime.gpu.layers.rotary import rope_parameters
from runtime.gpu.models.base import CausalLM
from runtime.mailbox.messages import SeqStart
from runtime.speculative.drafter import Drafter, Drafts, StepTokens, TokenHistory

log = structlog.get_logger(__name__)
PREFIX = "mtp."


class _Layer(nn.Module):
    """A pre-norm draft layer: attention over [context keys ; block] (GQA), then a SwiGLU MLP."""

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (roped) and values [..., kv_heads, head_dim] of inputs x [..., D]."""
        shape = (*x.shape[:-1], self.kv_heads, self.head_dim)
        return _rope(self.k_proj(x).view(shape), cos, sin), self.v_proj(x).view(shape)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_valid) -> torch.Tensor:  # noqa: ANN001
        """x [B, K, D] the block; ctx_k/v [B, W, kv_heads, hd]; ctx_valid [B, W]."""
        b, k, _ = x.shape
        h = _rms(x, self.input_layernorm, self.eps)
        q = _rope(self.q_proj(h).view(b, k, self.heads, self.head_dim), cos, sin)
        kb, vb = self.kv(h, cos, sin)
        keys, values = torch.cat([ctx_k, kb], 1), torch.cat([ctx_v, vb], 1)  # [B, W + K, kvh, hd]
        rep = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(rep, 2), values.repeat_interleave(rep, 2)
        mask = torch.cat([ctx_valid, torch.ones(b, k, dtype=torch.bool, device=x.device)], 1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None, None, :]
        )
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, k, -1))
        h = _rms(x, self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DSparkHead(nn.Module):
    """The drafter's own weights (embedding and head are the target's)."""

    def __init__(self, config, n_features: int, n_layers: int, rank: int) -> None:  # noqa: ANN001
        super().__init__()
        d, vocab = config.hidden_size, config.vocab_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
        head_dim = d // heads
        inter = getattr(config, "intermediate_size", None) or 2 * d
        self.eps = getattr(config, "rms_norm_eps", 1e-6)
        self.fc = nn.Linear(n_features * d, d, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.layers = nn.ModuleList(
            _Layer(d, heads, kv_heads, head_dim, inter, self.eps) for _ in range(n_layers)
        )
        self.norm = nn.Parameter(torch.ones(d))
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        self.confidence = nn.Linear(d + rank, 1)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return _rms(self.fc(features), self.hidden_norm, self.eps)


class DSparkDrafter(Drafter):
    follows_target = True
    graph_safe = True  # `observe` is fixed-shape device work: a padding row (no tokens) drafts junk

    def __init__(
        self,
        target: CausalLM,
        tables: StepTables,
        num_slots: int,
        max_draft: int,
        max_len: int,
        dtype: torch.dtype,
        model_path: Path,
        window: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__(max_draft)
        config, device = target.config, tables.req_to_token.device
        n_target = config.num_hidden_layers
        ids = getattr(config, "dspark_target_layer_ids", None) or sorted({0, n_target // 2, n_target - 1})
        if any(not 0 <= i < n_target for i in ids):
            raise ValueError(f"dspark target layers {ids} outside the model's {n_target} layers")
        self.target, self.tables, self.layer_ids = target, tables, list(ids)
        self.window = min(window, max_len)
        rows = tables.req_to_token.shape[0]
        self.mask_id = getattr(config, "dspark_noise_token_id", None)
        self.mask_id = config.vocab_size - 1 if self.mask_id is None else self.mask_id
        names = _mtp_names(model_path)
        if "0.main_proj.weight" in names:
            raise ValueError(
                "this checkpoint stores DeepSeek's own DSpark stages (DeepSeek-V4 blocks under mtp.0/1/2, "
                "as DeepSeek-V4-Flash-0731), which this drafter cannot read yet; it reads DSpark weights in "
                "its own layout (mtp.fc.weight, mtp.layers.{i}.*, mtp.markov_w1.weight, ...)"
            )
        tensors = _mtp_tensors(model_path) if "fc.weight" in names else {}
        if names and not tensors:
            log.warning(
                "the checkpoint's mtp.* tensors are not DSpark's (an MTP block?): random DSpark weights"
            )
        n_layers = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("layers.")), default=0)
        rank = getattr(config, "dspark_markov_rank", None) or min(256, config.hidden_size)
        if "markov_w1.weight" in tensors:
            rank = tensors["markov_w1.weight"].shape[1]
        head = DSparkHead(config, len(self.layer_ids), n_layers, rank)
        if tensors:
            head.load_state_dict(tensors, strict=True)
            log.info("dspark weights from the checkpoint", layers=n_layers, tensors=len(tensors))
        else:
            _random_init(head, seed)
            log.info("dspark weights random (no mtp.* tensors in the checkpoint)", layers=n_layers)
        self.head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
        layer0 = self.head.layers[0]
        shape = (num_slots, layer0.kv_heads, layer0.head_dim)
        self.ctx_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.head.layers]
        self.ctx_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.head.layers]
        # plain RoPE at the target's base (the draft layers' head size is their own)
        theta, hd = rope_parameters(config)["rope_theta"], layer0.head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        self.history = TokenHistory(rows, max_len, device)
        self.taps = tuple(self.layer_ids)

    def register(self, start: SeqStart) -> None:
        self.history.register(start)

    @torch.inference_mode()
    def capture(self, batch: ForwardBatch, hidden: torch.Tensor, graph: GraphStep | None = None) -> None:
        # a layer's output [T, D]; DeepSeek-V4's hyper-connection streams [T, n, D] are averaged
        features = [f.mean(1) if f.dim() == 3 else f for f in (batch.taps[i] for i in self.layer_ids)]
        ctx = self.head.context(torch.cat(features, -1).to(self.head.fc.weight.dtype))
        cos, sin = self._cos_sin(batch.positions)
        for layer, ck, cv in zip(self.head.layers, self.ctx_k, self.ctx_v, strict=True):
            k, v = layer.kv(ctx, cos[:, None], sin[:, None])
            ck[batch.out_loc], cv[batch.out_loc] = k, v

    @torch.inference_mode()
    def observe(self, step: StepTokens) -> Drafts:
        self.history.append(step)
        return self.draft(step.rows)

    def draft(self, rows: torch.Tensor) -> Drafts:
        """Each row's block from its last token and the context before it (device work only)."""
        k, w, device = self.max_draft, self.window, rows.device
        n = self.history.length[rows]
        # (a graph's padding row has no history: its -1 would index past the embedding)
        anchor = self.history.ids[rows, (n - 1).clamp(min=0)].clamp(min=0)
        pos = (n - 1)[:, None] + torch.arange(k, device=device)  # [B, K]
        ctx_pos = (n - 1)[:, None] - w + torch.arange(w, device=device)  # [B, W]
        ctx_valid = ctx_pos >= 0
        ctx_slots = self.tables.req_to_token[rows[:, None], ctx_pos.clamp(min=0)]
        ids = torch.cat([anchor[:, None], torch.full_like(pos[:, 1:], self.mask_id)], 1)
        x = self.target.model.embed_tokens(ids).to(self.head.norm.dtype)
        cos, sin = self._cos_sin(pos)
        cos, sin = cos[:, :, None], sin[:, :, None]
        for layer, ck, cv in zip(self.head.layers, self.ctx_k, self.ctx_v, strict=True):
            x = layer(x, cos, sin, ck[ctx_slots], cv[ctx_slots], ctx_valid)
        h = _rms(x, self.head.norm, self.head.eps)  # [B, K, D]
        base = self.target.compute_logits(h.reshape(-1, h.shape[-1])).view(*h.shape[:2], -1).float()
        prev, tokens, conf = anchor, [], []
        for j in range(k):
            e = self.head.markov_w1(prev)
            logits = base[:, j] + self.head.markov_w2(e).float()
            c = torch.sigmoid(self.head.confidence(torch.cat([h[:, j], e], -1)).float()).squeeze(-1)
            prev = logits.argmax(-1)
            tokens.append(prev)
            conf.append(c)
        return Drafts(torch.stack(tokens, 1), torch.full_like(n, k), torch.stack(conf, 1))

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], -1)
        dtype = self.head.norm.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _mtp_names(model_path: Path) -> set[str]:
    """The checkpoint's `mtp.*` tensor names without the prefix, read from the files' headers only."""
    from safetensors import safe_open

    out: set[str] = set()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update(n[len(PREFIX) :] for n in st.keys() if n.startswith(PREFIX))  # noqa: SIM118
    return out


def _mtp_tensors(model_path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.*` tensors, names without the prefix (empty when it has none)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.startswith(PREFIX):
                    out[name[len(PREFIX) :]] = st.get_tensor(name)
    return out


@torch.no_grad()
def _random_init(head: DSparkHead, seed: int, std: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)

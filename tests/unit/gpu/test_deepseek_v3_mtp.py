"""MTP layers (`model.layers.{num_hidden_layers + i}`) load from a checkpoint and run: their output equals
transformers' generic `MtpLayer` over the same DeepSeek-V3 decoder layer; checkpoints without them load."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from runtime.config import RunnerConfig
from runtime.gpu.model_runner import ModelRunner
from runtime.gpu.testing import PlanBuilder, save_tiny_deepseek_v3, seq_start


def _checkpoint_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory names (fused experts, mtp_block., post_norm) -> released-checkpoint names."""
    out = {}
    for name, t in state.items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{base}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{prefix}{base}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{prefix}{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            out[prefix + name] = t
    return out


def test_mtp_layer_loads_and_matches_transformers_mtp_layer(tmp_path):
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    ref = save_tiny_deepseek_v3(tmp_path, seed=5, num_nextn_predict_layers=1)
    n = ref.config.num_hidden_layers
    torch.manual_seed(1)
    mtp = MtpLayer(ref.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, n).float().eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.05)
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.2, 0.2)
    tensors = load_file(tmp_path / "model.safetensors")
    state = {**dict(mtp.named_parameters()), **dict(mtp.named_buffers())}
    tensors.update(_checkpoint_names({k: v.detach() for k, v in state.items()}, f"model.layers.{n}."))
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]  # stored copies
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")

    runner = ModelRunner(RunnerConfig(str(tmp_path), num_kv_slots=256, max_reqs=2, max_model_len=64))
    assert len(runner.model.mtp_layers) == 1 and len(runner.kv_pool.kv) == n + 1
    length = 12
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (length,), generator=g).tolist()
    hidden = torch.randn(length, ref.config.hidden_size, generator=g)
    plan = PlanBuilder().plan([1], [0], [length], ids, added=[seq_start(1, ids)])
    batch = runner.prepare_batch(plan)
    with torch.inference_mode():
        ours = runner.model.mtp_forward(0, batch.input_ids, hidden, batch.positions, batch, runner.attn)

    positions = torch.arange(length)[None]
    with torch.no_grad():
        embeds = ref.model.embed_tokens(torch.tensor([ids]))
        rope = ref.model.rotary_emb(embeds, positions)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        expected = mtp(embeds, hidden[None], rope, mask, positions, None)[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_checkpoint_without_mtp_layers_loads_and_drops_them(tmp_path):
    save_tiny_deepseek_v3(tmp_path, seed=6, num_nextn_predict_layers=1)  # transformers saves no MTP weights
    runner = ModelRunner(RunnerConfig(str(tmp_path), num_kv_slots=64, max_reqs=2, max_model_len=64))
    assert runner.model.mtp_layers == [] and len(runner.kv_pool.kv) == runner.config.num_hidden_layers

"""Named model shapes for `--load-format dummy`: performance work on a real architecture, no downloads.

`--model llama-3.1-8b --load-format dummy` runs the Llama-3.1-8B shape with random weights. A preset is
written once as a config.json directory under the cache dir, so everything that reads a model
directory (the loader, the frontend's model info) works unchanged. Presets have no tokenizer: the
frontend falls back to the embedded SmolLM2 one, whose ids (< 49152) fit each preset's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from runtime import envs

_LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    rms_norm_eps=1e-5,
    torch_dtype="bfloat16",
)

# DeepSeek-V4-Flash's config.json as released (values: transformers' DeepseekV4Config defaults, which are
# Flash's, and public copies of the file; docs/deepseek_v4.md). Upstream keys transformers folds:
# `compress_ratios` (0 sliding, 4 CSA, 128 HCA; 43 layers + the MTP block), `num_hash_layers`,
# `qk_rope_head_dim`. The released weights are FP8 with FP4 experts (`expert_dtype`); dummy weights take
# --dtype unless `--quantization fp8` makes them in those formats, so no quantization_config here.
_V4_FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],
    compress_rope_theta=160000.0,
    rope_theta=10000.0,
    rope_scaling=dict(
        type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1
    ),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    moe_intermediate_size=2048,
    num_hash_layers=3,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    expert_dtype="fp4",
    num_nextn_predict_layers=1,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    torch_dtype="bfloat16",
)

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        _LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-3.2-1b": dict(
        _LLAMA,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    # 284B total, 13B active: on one GPU cut it with --hf-overrides '{"num_hidden_layers": 8}'
    "deepseek-v4-flash": _V4_FLASH,
    # DeepSeek-V2-Lite's config.json as released (15.7B total, 2.4B active; 31.4 GB in bf16): MLA without
    # a q LoRA, 64 routed experts of which 6 per token (softmax gating, greedy top-k), 2 shared
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        first_k_dense_replace=1,
        moe_layer_freq=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        hidden_act="silu",
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),  # fmt: skip
        rms_norm_eps=1e-6,
        bos_token_id=100000,
        eos_token_id=100001,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # DeepSeek-V3's config.json as released (671B total, 37B active) in bf16 (the released weights are
    # FP8: `--quantization fp8` stores the dummy weights that way): on one GPU cut it with --hf-overrides
    # '{"num_hidden_layers": 4}' (1 dense + 3 MoE layers, 73.9 GB in bf16)
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        first_k_dense_replace=3,
        moe_layer_freq=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),  # fmt: skip
        rms_norm_eps=1e-6,
        num_nextn_predict_layers=1,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
}


def is_preset(name: str | None) -> bool:
    return name in PRESETS


def preset_dir(name: str) -> Path:
    """The directory holding the preset's config.json, written on first use."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    path = envs.cache_dir() / "presets" / name
    cfg = path / "config.json"
    text = json.dumps(PRESETS[name], indent=2, sort_keys=True)
    if not cfg.is_file() or cfg.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(cfg)
    return path


def resolve(model: str) -> str:
    """A model directory for `model`: a preset name becomes its config directory; a path stays."""
    if not Path(model).exists() and is_preset(model):
        return str(preset_dir(model))
    return model

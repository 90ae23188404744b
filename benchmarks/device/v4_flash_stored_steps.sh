#!/usr/bin/env bash
# docs/deepseek_v4.md "Weights as stored": DeepSeek-V4-Flash with FP8 projections and FP4 routed experts
# (`--quantization fp8`, dummy weights made in those formats). (1) how many layers fit this GPU, bf16 vs
# as stored (benchmarks/v4_layers_fit.py, from the parameter bytes and the card's memory); (2) the FP4
# `fused_moe` kernels against the reference at V4-Flash's experts, with their bandwidth; (3) decode (k=0)
# and verify (k=3) steps of the 8-layer cut as stored at context 8K (beside the bf16 verify table);
# (4) the largest cut that fits (LAYERS=N to override), a few decode steps. About 8 minutes.
#   source .gpu/env.sh && bash benchmarks/device/v4_flash_stored_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_flash_stored_steps)
describe_machine "$dir"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
capacity=$((mib / 1024))
$PY -m benchmarks.v4_layers_fit --capacity-gib "$capacity" 2>&1 | tee "$dir/layers_fit.txt"
$PY -m pytest -q -s tests/gpu/test_kernels_fused_moe.py -k "fp4" 2>&1 | tee "$dir/fused_moe_fp4.txt"
$PY -m loadgen steps --model-path deepseek-v4-flash --quantization fp8 --hf-overrides "$V4_OVERRIDES" \
  --page-size 128 --batch-sizes 1,8,64 --context-len 8192 --draft-tokens 0,3 --prefill-tokens "" --steps 5 \
  ${EXTRA:-} 2>&1 | tee "$dir/steps_8_layers.txt"
layers=${LAYERS:-$($PY -m benchmarks.v4_layers_fit --layers-only --capacity-gib "$capacity")}
$PY -m loadgen steps --model-path deepseek-v4-flash --quantization fp8 \
  --hf-overrides "{\"num_hidden_layers\": $layers, \"num_nextn_predict_layers\": 0}" \
  --page-size 128 --batch-sizes 1,16,64 --context-len 1024 --prefill-tokens "" --steps 5 \
  2>&1 | tee "$dir/steps_${layers}_layers.txt"

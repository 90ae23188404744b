#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash decode (8 layers)": decode steps of the 8-layer V4-Flash cut (dummy
# bf16, 107.5 GB) at batch 1 / 16 / 64, context 1024, with CUDA graphs and eagerly in the same process,
# and an 8K-token prefill. About 5 minutes.
#   source .gpu/env.sh && bash benchmarks/device/v4_flash_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_flash_steps)
describe_machine "$dir"
$PY -m loadgen steps --model-path deepseek-v4-flash --hf-overrides "$V4_OVERRIDES" --page-size 128 \
  --batch-sizes 1,16,64 --context-len 1024 --prefill-tokens 8192 --cuda-graph both --steps 5 \
  2>&1 | tee "$dir/steps.txt"

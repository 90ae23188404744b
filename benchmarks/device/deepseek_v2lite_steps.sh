#!/usr/bin/env bash
# docs/PERF.md "Fused MoE at DeepSeek-V2-Lite and V3 shapes", the models: decode steps of the V2-Lite
# shape (dummy bf16, CUDA graphs, context 128) at batch 1 / 64 / 128 and an 8K-token prefill. The
# config is written under $OUT. About 3 minutes.
#   source .gpu/env.sh && bash benchmarks/device/deepseek_v2lite_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results deepseek_v2lite_steps)
describe_machine "$dir"
write_v2lite_config "$dir/v2lite"
$PY -m loadgen steps --model-path "$dir/v2lite" --batch-sizes 1,64,128 --context-len 128 \
  --prefill-tokens 8192 --cuda-graph on --steps 10 2>&1 | tee "$dir/steps.txt"

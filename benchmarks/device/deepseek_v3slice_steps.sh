#!/usr/bin/env bash
# docs/PERF.md "Fused MoE at DeepSeek-V2-Lite and V3 shapes", the models: decode steps of a 4-layer
# DeepSeek-V3 slice (V3's dimensions, 1 dense + 3 MoE layers, 73.9 GB of dummy bf16 weights), CUDA
# graphs: context 128 at batch 1 / 64 / 128 with an 8K-token prefill, then context 4096 at batch 64 / 128
# in pages of 64 (MLA copies whole tiles by TMA through a page table). The config is written under
# $OUT. About 6 minutes.
#   source .gpu/env.sh && bash benchmarks/device/deepseek_v3slice_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results deepseek_v3slice_steps)
describe_machine "$dir"
write_v3slice_config "$dir/v3slice"
$PY -m loadgen steps --model-path "$dir/v3slice" --batch-sizes 1,64,128 --context-len 128 \
  --prefill-tokens 8192 --cuda-graph on --steps 10 2>&1 | tee "$dir/steps-ctx128.txt"
$PY -m loadgen steps --model-path "$dir/v3slice" --batch-sizes 64,128 --context-len 4096 \
  --prefill-tokens 1024 --steps 10 --warmup-steps 2 --page-size 64 2>&1 | tee "$dir/steps-ctx4096-page64.txt"

#!/usr/bin/env bash
# docs/parallelism.md "The EP path on one GPU": the expert-parallel exchange at world size 1 under CUDA
# graphs against the plain fused MoE, DeepSeek-V2-Lite shape (dummy bf16, 64 experts, context 128):
# the gpu test asserts the EP path's decode step is within 3% (batch 1 and 64, interleaved), then
# `loadgen steps` prints both paths' decode and prefill rows side by side. About 5 minutes.
#   source .gpu/env.sh && bash benchmarks/device/ep_world1.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results ep_world1)
describe_machine "$dir"
$PY -m pytest -q -s tests/gpu/test_expert_parallel_world1_cuda.py 2>&1 | tee "$dir/test.txt"
write_v2lite_config "$dir/v2lite"
for backend in auto all_to_all; do
  echo "== --moe-a2a-backend $backend" | tee -a "$dir/steps.txt"
  $PY -m loadgen steps --model-path "$dir/v2lite" --batch-sizes 1,64 --context-len 128 \
    --prefill-tokens 4096 --cuda-graph on --steps 10 --moe-a2a-backend "$backend" 2>&1 | tee -a "$dir/steps.txt"
done

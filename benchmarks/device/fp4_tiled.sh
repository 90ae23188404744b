#!/usr/bin/env bash
# docs/PERF.md "The experts tiled at load": the FP4 experts' kernels on the tiled form, checked and timed
# in one command. (1) tests/gpu/test_kernels_fused_moe.py -k fp4: every form against the reference (the
# mma kernels on the tiled form, every code and scale, CUDA-graph replay), with each point's bandwidth;
# (2) fp4_mma_sweep at decode, verify and prefill token counts (`TOKENS`), `dot_scaled` on both forms
# beside the mma knobs (`FORMS`); (3) the V4 GPU tests whose tiny FP4 experts are tileable (stored
# weights against the dequantized model, graphs against eager) and the V4 decode tests. About 5 minutes.
#   source .gpu/env.sh && bash benchmarks/device/fp4_tiled.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results fp4_tiled)
describe_machine "$dir"
status=0
$PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels_fused_moe.py -k fp4 2>&1 \
  | tee "$dir/fused_moe_fp4.txt" | grep -E "fp4 |passed|failed|rror" || status=1
$PY -m benchmarks.kernels.fp4_mma_sweep --tokens "${TOKENS:-64,256,4096}" \
  --forms "${FORMS:-2:8:1,1:8:1:2,3:8:1,2:16:1,2:32:0}" 2>&1 | tee "$dir/sweep.txt" | grep -E "T=|copy|rror" || status=1
$PY -m pytest -q -p no:cacheprovider tests/gpu/test_deepseek_v4_stored_weights_cuda.py tests/gpu/test_deepseek_v4_cuda.py \
  2>&1 | tee "$dir/v4_tests.txt" | tail -5 || status=1
exit $status

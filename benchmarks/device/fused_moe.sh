#!/usr/bin/env bash
# docs/PERF.md "Fused MoE at DeepSeek-V2-Lite and V3 shapes", the op: fused_moe at V2-Lite's, V3's and
# V4-Flash's routed experts (bf16; FP8 W8A8 at V3's; FP4 W4A16 at V4-Flash's) for 1 / 64 / 128 / 4096
# tokens, against the copy and matmul ceilings of the same run. About 3 minutes.
#   source .gpu/env.sh && bash benchmarks/device/fused_moe.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results fused_moe)
describe_machine "$dir"
$PY -m benchmarks.kernels.ops --ops fused_moe 2>&1 | tee "$dir/bench.txt"
$PY -m benchmarks.kernels.moe_layout 2>&1 | tee "$dir/layout.txt"
# TUNE_FP4=1: V4-Flash's FP4 experts, the forms of the K step (MoEConfig.fp4_step) over the tiles
# at decode and verify token counts (docs/PERF.md "DeepSeek-V4-Flash as stored"). About 6 minutes more.
if [ "${TUNE_FP4:-0}" = 1 ]; then
  $PY -m benchmarks.kernels.fused_moe_tune --models v4 --tokens ${TOKENS:-8,64,256} --block-m ${BLOCK_M:-16,32} \
    --fp4-steps ${FP4_STEPS:-values,scaled} 2>&1 | tee "$dir/tune_fp4.txt"
fi

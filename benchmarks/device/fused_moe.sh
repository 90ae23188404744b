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

#!/usr/bin/env bash
# docs/PERF.md "Fused MoE at DeepSeek-V2-Lite and V3 shapes", the op: fused_moe at V2-Lite's and V3's
# routed experts (bf16, and FP8 W8A8 at V3's) for 1 / 64 / 128 / 4096 tokens, against the copy and
# matmul ceilings of the same run. About 2 minutes.
#   source .gpu/env.sh && bash benchmarks/device/fused_moe.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results fused_moe)
describe_machine "$dir"
$PY -m benchmarks.kernels.ops --ops fused_moe 2>&1 | tee "$dir/bench.txt"

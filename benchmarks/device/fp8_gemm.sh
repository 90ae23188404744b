#!/usr/bin/env bash
# docs/PERF.md "FP8 block GEMM against DeepGEMM": the TileLang FP8 block GEMM (its chosen config, the
# persistent kernel at M = 4096) at DeepSeek-V3's three shapes, checked against the reference, with
# torch._scaled_mm at each shape and the ratio to DeepGEMM's H800 figures. About 3 minutes.
#   source .gpu/env.sh && bash benchmarks/device/fp8_gemm.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results fp8_gemm)
describe_machine "$dir"
$PY -m benchmarks.kernels.fp8_gemm --impls tilelang --shapes 4096:4096:7168 4096:7168:2048 4096:2112:7168 \
  2>&1 | tee "$dir/bench.txt"

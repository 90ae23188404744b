#!/usr/bin/env bash
# docs/PERF.md "fp8 KV decode attention kernel (Llama-3.1-8B heads)": the TileLang fp8 decode kernel's
# default launch (ring 5, slots 2 tiles ahead, 2 persistent CTAs per SM) per layer of the Llama-3.1-8B
# shape over e4m3 pages of 64, beside Triton's default launch, round-robin over 3 rounds; each checked
# against the reference. About 3 minutes (TileLang compiles first).
#   source .gpu/env.sh && bash benchmarks/device/fp8_kv_decode.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results fp8_kv_decode)
describe_machine "$dir"
$PY -m benchmarks.kernels.decode_attention_sweep --kv-dtype fp8 --page-size 64 --rounds 3 \
  --tilelang 2>&1 | tee "$dir/sweep.txt"

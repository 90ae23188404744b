#!/usr/bin/env bash
# docs/engram.md "Figures": Engram lookup throughput (rows/s) of host shards and device tables at 4K,
# 16K and 64K tokens per step (the demo's tables: layers 1 and 15, 20.7M rows x 64, bf16), then the
# step-time overhead of Engram (host and device tables, layers 1 and 5) on the dummy 8-layer
# DeepSeek-V4-Flash cut at decode batch 1 / 16 / 64, context 1024, eager on both sides. About 10 minutes.
#   source .gpu/env.sh && bash benchmarks/device/engram.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results engram)
describe_machine "$dir"
$PY -m benchmarks.engram_lookup lookup --tokens 4096,16384,65536 --placements device,host --shards 4 \
  --out "$dir/lookup.json" 2>&1 | tee "$dir/lookup.txt"
$PY -m benchmarks.engram_lookup steps --model deepseek-v4-flash --hf-overrides "$V4_OVERRIDES" \
  --engram-layers 1,5 --placements host,device --shards 4 --batch-sizes 1,16,64 --context 1024 \
  --tokenizer "$(tokenizer_dir)" --out "$dir/steps.json" 2>&1 | tee "$dir/steps.txt"

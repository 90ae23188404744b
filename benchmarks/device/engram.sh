#!/usr/bin/env bash
# docs/engram.md "Figures": Engram lookup throughput (rows/s) of host shards and device tables at 4K,
# 16K and 64K tokens per step (the demo's tables: layers 1 and 15, 20.7M rows x 64, bf16): the
# mailbox fetch, and the in-step gather from device memory and from the mapped host table; then the
# step-time overhead of Engram (device tables, mapped host tables, both in CUDA graphs, and host shards
# over the mailbox, eager) against the model without Engram in CUDA graphs, on the dummy 8-layer
# DeepSeek-V4-Flash cut with Engram at layers 2 and 6, decode batch 1 / 16 / 64, context 1024.
# About 10 minutes. SHORT=1: the 4-layer cut with Engram at layers 1 and 3 (the first figure's setup),
# batch 16, no lookup sweep: about 4 minutes.
#   source .gpu/env.sh && bash benchmarks/device/engram.sh          (carry .gpu and out/tokenizer)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results engram)
describe_machine "$dir"
if [ "${SHORT:-0}" = 1 ]; then
  $PY -m benchmarks.engram_lookup steps --model deepseek-v4-flash \
    --hf-overrides '{"num_hidden_layers": 4, "num_nextn_predict_layers": 0}' --engram-layers 1,3 \
    --placements host,device,host-mailbox --shards 4 --batch-sizes 16 --context 1024 --steps 10 \
    --tokenizer "$(tokenizer_dir)" --out "$dir/steps_short.json" 2>&1 | tee "$dir/steps_short.txt"
  exit 0
fi
$PY -m benchmarks.engram_lookup lookup --tokens 4096,16384,65536 --placements device,host --shards 4 \
  --out "$dir/lookup.json" 2>&1 | tee "$dir/lookup.txt"
$PY -m benchmarks.engram_lookup steps --model deepseek-v4-flash --hf-overrides "$V4_OVERRIDES" \
  --engram-layers 2,6 --placements host,device,host-mailbox --shards 4 --batch-sizes 1,16,64 --context 1024 \
  --tokenizer "$(tokenizer_dir)" --out "$dir/steps.json" 2>&1 | tee "$dir/steps.txt"

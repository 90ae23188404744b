#!/usr/bin/env bash
# docs/PERF.md "Llama-3.1-8B shape, one H200: engine steps": decode step MBU at batch 1 and 256
# (context 1024, bf16 KV, CUDA graphs, overlapped), prefill MFU at 1K / 8K / 32K tokens, each against
# the copy and matmul ceilings the same process measures. The decode run is repeated ROUNDS times
# (default 2) in separate processes, for a range. About 4 minutes.
#   source .gpu/env.sh && bash benchmarks/device/llama8b_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results llama8b_steps)
describe_machine "$dir"
for r in $(seq 1 "${ROUNDS:-2}"); do
  $PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 1,256 --context-len 1024 \
    --prefill-tokens 8192 --cuda-graph on --steps 20 2>&1 | tee "$dir/decode-r$r.txt"
done
$PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 1 --prefill-tokens 1024,8192,32768 --steps 3 \
  2>&1 | tee "$dir/prefill.txt"

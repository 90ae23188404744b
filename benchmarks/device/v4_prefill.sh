#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash prefill (8 layers)" (issue 31): prefill steps of 4K, 8K, 16K, 32K and
# 64K new tokens on the 8-layer V4-Flash cut (dummy bf16, 107.5 GB, pages of 128) after CONTEXT cached
# tokens (default 65536: 68K..128K in all; CONTEXT=0: fresh prompts), each against the roofline of the
# ceilings the same process measures (`roof ms`, `layer ms`, `%roof`). One context per device call (each
# loads the model); TOKENS picks the points; QUANT=fp8 keeps the weights as stored (30.8 GB: fits an
# H100); EXTRA="--profile-steps 1" adds each point's kernel table. Estimated 5 minutes a call.
#   source .gpu/env.sh && CONTEXT=65536 bash benchmarks/device/v4_prefill.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
ctx=${CONTEXT:-65536}
dir=$(results "v4_prefill_ctx$ctx")
describe_machine "$dir"
# a 64K-token step allocates activations of many sizes next to 107.5 GB of weights: grow segments in
# place rather than leave the cache fragmented
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
$PY -m loadgen steps --model-path deepseek-v4-flash ${QUANT:+--quantization $QUANT} --hf-overrides "$V4_OVERRIDES" \
  --page-size 128 --batch-sizes "" --prefill-tokens "${TOKENS:-4096,8192,16384,32768,65536}" --prefill-context "$ctx" \
  --cuda-graph off --steps 3 --warmup-steps 1 ${EXTRA:-} 2>&1 | tee "$dir/steps.txt"

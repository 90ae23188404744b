#!/usr/bin/env bash
# docs/PERF.md "Verify steps under CUDA graphs": decode steps of k=0 (a plain runner) beside verify
# steps of k=3 drafts (a runner speculating with the n-gram drafter: the verify graphs, every position
# sampled, the drafter's observe included), overlapped, each against the ceilings the same process
# measures; one process per (model, context, k) so the k=0 runner has no drafter. Llama-3.1-8B shape
# (dummy bf16, bf16 KV) at batch 1-256, contexts 2K and 8K; DeepSeek-V2-Lite shape (MLA, 64 experts,
# pages of 64) at batch 1-256, context 3.9K (under its 4K positions). MODELS="llama llama8k v2lite" and KS="0 3" pick (llama8k: contexts of 8K
# at batch 8 and 32).
#   source .gpu/env.sh && bash benchmarks/device/verify_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results verify_steps)
describe_machine "$dir"
models=${MODELS:-llama v2lite}
write_v2lite_config "$dir/v2lite"
for k in ${KS:-0 3}; do
  if [[ $models == *llama* ]]; then
    $PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 1,8,64,256 --context-len 2048 \
      --draft-tokens $k --prefill-tokens "" --steps 20 2>&1 | tee "$dir/llama-ctx2k-k$k.txt"
  fi
  if [[ $models == *llama8k* ]]; then
    $PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 8,32 --context-len 8192 \
      --draft-tokens $k --prefill-tokens "" --steps 20 2>&1 | tee "$dir/llama-ctx8k-k$k.txt"
  fi
  if [[ $models == *v2lite* ]]; then
    $PY -m loadgen steps --model-path "$dir/v2lite" --batch-sizes 1,8,64,256 --context-len 3900 \
      --page-size 64 --draft-tokens $k --prefill-tokens "" --steps 20 2>&1 | tee "$dir/v2lite-ctx4k-k$k.txt"
  fi
done

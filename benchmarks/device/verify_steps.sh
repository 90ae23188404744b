#!/usr/bin/env bash
# docs/PERF.md "Verify steps under CUDA graphs": Llama-3.1-8B shape (dummy bf16 weights, bf16 KV), decode
# steps of k=0 (a plain runner) beside verify steps of k=3 drafts (a runner speculating with the n-gram
# drafter: the verify graphs, every position sampled, the drafter's observe included), at batch 1-256,
# contexts 2K and 8K, overlapped, each against the ceilings the same process measures. Two processes
# per context so the k=0 runner has no drafter.
#   source .gpu/env.sh && bash benchmarks/device/verify_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results verify_steps)
describe_machine "$dir"
for k in 0 3; do
  $PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 1,8,64,256 --context-len 2048 \
    --draft-tokens $k --prefill-tokens "" --steps 20 2>&1 | tee "$dir/ctx2k-k$k.txt"
  $PY -m loadgen steps --model-path llama-3.1-8b --batch-sizes 8,32 --context-len 8192 \
    --draft-tokens $k --prefill-tokens "" --steps 20 2>&1 | tee "$dir/ctx8k-k$k.txt"
done

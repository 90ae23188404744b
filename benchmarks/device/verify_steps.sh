#!/usr/bin/env bash
# docs/PERF.md "Verify steps under CUDA graphs": decode steps of k=0 (a plain runner) beside verify
# steps of k=3 drafts (a runner speculating with the n-gram drafter: the verify graphs, every position
# sampled, the drafter's observe included), overlapped, each against the ceilings the same process
# measures; one process per (model, context, k) so the k=0 runner has no drafter. Llama-3.1-8B shape
# (dummy bf16, bf16 KV) at batch 1-256, contexts 2K and 8K; DeepSeek-V2-Lite shape (MLA, 64 experts,
# pages of 64) at batch 1-256, context 3.9K (under its 4K positions); the 4-layer DeepSeek-V3 slice
# (v3slice: V3's dimensions, 1 dense + 3 MoE layers, 73.9 GB) at batch 8-256, context 3.9K, pages of 64;
# the 8-layer DeepSeek-V4-Flash cut
# (dummy bf16, pages of 128: the batched V4 path, attention_decode.py) at batch 8-256, context 8K (v4)
# and at batch 32, context 128K (v4long). MODELS="llama llama8k v2lite v3slice v4 v4long" and KS="0 3" pick
# (llama8k: contexts of 8K at batch 8 and 32); a V4 process loads 107.5 GB of weights and captures its
# graphs, so run one model and one k a command (MODELS=v4 KS=3). EXTRA="--profile-steps 3": V2-Lite's
# points also print their kernels' device time.
#   source .gpu/env.sh && bash benchmarks/device/verify_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results verify_steps)
describe_machine "$dir"
models=${MODELS:-llama v2lite}
write_v2lite_config "$dir/v2lite"
[[ $models == *v3slice* ]] && write_v3slice_config "$dir/v3slice"
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
      --page-size 64 --draft-tokens $k --prefill-tokens "" --steps 20 ${EXTRA:-} 2>&1 | tee "$dir/v2lite-ctx4k-k$k.txt"
  fi
  if [[ $models == *v3slice* ]]; then
    $PY -m loadgen steps --model-path "$dir/v3slice" --batch-sizes 8,64,256 --context-len 3900 \
      --page-size 64 --draft-tokens $k --prefill-tokens "" --steps 20 ${EXTRA:-} 2>&1 | tee "$dir/v3slice-ctx4k-k$k.txt"
  fi
  if [[ " $models " == *" v4 "* ]]; then
    $PY -m loadgen steps --model-path deepseek-v4-flash --hf-overrides "$V4_OVERRIDES" --page-size 128 \
      --batch-sizes 8,64,256 --context-len 8192 --draft-tokens $k --prefill-tokens "" --steps 20 \
      2>&1 | tee "$dir/v4-ctx8k-k$k.txt"
  fi
  if [[ " $models " == *" v4long "* ]]; then
    $PY -m loadgen steps --model-path deepseek-v4-flash --hf-overrides "$V4_OVERRIDES" --page-size 128 \
      --batch-sizes 32 --context-len 131072 --draft-tokens $k --prefill-tokens "" --steps 20 \
      2>&1 | tee "$dir/v4-ctx128k-k$k.txt"
  fi
done

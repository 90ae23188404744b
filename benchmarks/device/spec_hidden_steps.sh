#!/usr/bin/env bash
# docs/PERF.md "Hidden-state drafters under CUDA graphs": verify steps (k=3) of the MTP and DSpark
# drafters, which read the target's hidden states and tapped layers, replayed as CUDA graphs (the graphs
# hand the states over) against the same steps run eagerly (`--cuda-graph both`: graph and eager rows in
# one process), beside the plain decode step (k=0). A 2-layer DeepSeek-V4-Flash cut with its MTP block
# (dummy bf16, pages of 128, context 8K, batch 8 and 64): both drafters draft on the device right after
# each step (MTP chains its layer k times, DSpark runs its block pass; random weights), inside the step's
# time. One process per algorithm (about 40 GB of weights). About 4 minutes.
#   source .gpu/env.sh && bash benchmarks/device/spec_hidden_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results spec_hidden_steps)
describe_machine "$dir"
cut='{"num_hidden_layers": 2, "num_nextn_predict_layers": 1}'
common=(--model-path deepseek-v4-flash --hf-overrides "$cut" --page-size 128 --batch-sizes ${BATCHES:-8,64}
        --context-len 8192 --prefill-tokens "" --steps 10)
$PY -m loadgen steps "${common[@]}" --draft-tokens 0 2>&1 | tee "$dir/plain-k0.txt"
for algo in ${ALGOS:-mtp dspark}; do
  $PY -m loadgen steps "${common[@]}" --draft-tokens 3 --speculative-algorithm "$algo" --cuda-graph both \
    2>&1 | tee "$dir/$algo-k3.txt"
done

#!/usr/bin/env bash
# docs/PERF.md "Hidden-state drafters under CUDA graphs": verify steps (k=3) of the MTP and DSpark
# drafters, which read the target's hidden states and tapped layers, replayed as CUDA graphs (the graphs
# hand the states over) against the same steps run eagerly (`--cuda-graph both`: graph and eager rows in
# one process), beside the plain decode step (k=0). Both drafters draft on the device right after each
# step, inside the step's time (MTP chains its layer k times, DSpark runs its block pass; random
# weights); on the graph rows their drafting replays as CUDA graphs too (observe_graph.py). One process
# per algorithm.
# - v4: a 2-layer DeepSeek-V4-Flash cut with its MTP block (dummy bf16, about 40 GB), pages of 128,
#   context 8K, batch 8 and 64; mtp and dspark.
# - v2lite: DeepSeek-V2-Lite's shapes (V3 architecture) with one MTP layer (32.5 GB), pages of 64,
#   context 3.9K (under its 4K positions), batch 8 and 64; mtp.
# About 4 minutes a model.
#   source .gpu/env.sh && MODELS="v2lite v4" bash benchmarks/device/spec_hidden_steps.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results spec_hidden_steps)
describe_machine "$dir"
for model in ${MODELS:-v4}; do
  if [ "$model" = v4 ]; then
    common=(--model-path deepseek-v4-flash --hf-overrides '{"num_hidden_layers": 2, "num_nextn_predict_layers": 1}'
            --page-size 128 --context-len 8192)
    algos=${ALGOS:-mtp dspark}
  else
    write_v2lite_config "$dir/v2lite"
    common=(--model-path "$dir/v2lite" --hf-overrides '{"num_nextn_predict_layers": 1}' --page-size 64
            --context-len 3900)
    algos=${ALGOS:-mtp}
  fi
  common+=(--batch-sizes ${BATCHES:-8,64} --prefill-tokens "" --steps 10 ${EXTRA:-})
  $PY -m loadgen steps "${common[@]}" --draft-tokens 0 2>&1 | tee "$dir/$model-plain-k0.txt"
  for algo in $algos; do
    $PY -m loadgen steps "${common[@]}" --draft-tokens 3 --speculative-algorithm "$algo" --cuda-graph both \
      2>&1 | tee "$dir/$model-$algo-k3.txt"
  done
done

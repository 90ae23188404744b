#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash decode (8 layers)", served: the 8-layer V4-Flash cut behind
# `conduit serve` (started and stopped by `loadgen ab`), 48 shared-prefix requests (4 groups of 12, a
# 1024-token system prompt, 128-token questions, 32 output tokens), 16 in flight. About 5 minutes.
# Needs out/tokenizer (prepare_tokenizer.sh) carried with .gpu.
#   source .gpu/env.sh && bash benchmarks/device/v4_flash_serve.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_flash_serve)
tok=$(tokenizer_dir)
describe_machine "$dir"
server="--model deepseek-v4-flash --load-format dummy --device cuda --tokenizer $tok"
server="$server --hf-overrides '$V4_OVERRIDES' --max-running-requests 32 --max-total-tokens 131072"
$PY -m loadgen ab --out-dir "$dir" --variant v4flash8 "$server" \
  --backend completions --dataset-name shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 12 \
  --gsp-system-prompt-len 1024 --gsp-question-len 128 --gsp-output-len 32 --max-concurrency 16 \
  --disable-tqdm 2>&1 | tee "$dir/ab.txt"

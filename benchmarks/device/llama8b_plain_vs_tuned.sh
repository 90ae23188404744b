#!/usr/bin/env bash
# docs/PERF.md "Llama-3.1-8B shape, one H200: end to end", the plain command: `conduit serve --model
# llama-3.1-8b --load-format dummy --device cuda` with no tuning flags beside the best bf16-KV flags found
# (larger steps, pages of 64), same benchmark as llama8b_e2e.sh (512 requests of 1000/1000 tokens, 256
# in flight), servers interleaved over ROUNDS rounds. Both size their KV pool from the GPU's memory.
# Needs out/tokenizer (prepare_tokenizer.sh) carried with .gpu.
#   source .gpu/env.sh && bash benchmarks/device/llama8b_plain_vs_tuned.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results llama8b_plain_vs_tuned)
tok=$(tokenizer_dir)
describe_machine "$dir"
plain="--model llama-3.1-8b --load-format dummy --device cuda --tokenizer $tok"
tuned="$plain --chunked-prefill-size 32768 --page-size 64 ${TUNED_EXTRA:-}"
$PY -m loadgen ab --out-dir "$dir" --rounds "${ROUNDS:-1}" --variant plain "$plain" --variant tuned "$tuned" \
  --backend completions --dataset-name random-ids --num-prompts 512 --random-input-len 1000 \
  --random-output-len 1000 --random-range-ratio 1.0 --max-concurrency 256 --warmup-requests 1 \
  --disable-tqdm 2>&1 | tee "$dir/ab.txt"
grep -h "kv_pool\|chunked_prefill_size\|cuda_graphs_captured" "$dir"/*.server.log | tee "$dir/pools.txt" || true

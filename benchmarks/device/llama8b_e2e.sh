#!/usr/bin/env bash
# docs/PERF.md "Llama-3.1-8B shape, one H200: end to end": 512 requests of 1000 random prompt ids and
# 1000 output tokens, 256 in flight, against the tuned server (fp8 KV, pages of 64, 32K-token steps).
# `loadgen ab` starts the server on a free loopback port, waits for /health, runs the benchmark (SM clock
# and power sampled by nvidia-smi) and stops it. WITH_PLAIN=1 also runs the plain command (the preset
# with default flags) in the same call; ROUNDS=N interleaves N rounds. About 3 minutes a server.
# Needs out/tokenizer (prepare_tokenizer.sh) carried with .gpu.
#   source .gpu/env.sh && bash benchmarks/device/llama8b_e2e.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results llama8b_e2e)
tok=$(tokenizer_dir)
describe_machine "$dir"
plain="--model llama-3.1-8b --load-format dummy --device cuda --tokenizer $tok"
tuned="$plain --kv-cache-dtype fp8_e4m3 --page-size 64 --chunked-prefill-size 32768 --max-running-requests 256"
tuned="$tuned --max-total-tokens 600000"
variants=(--variant tuned "$tuned")
if [ "${WITH_PLAIN:-0}" = 1 ]; then
  variants+=(--variant plain "$plain")
fi
$PY -m loadgen ab --out-dir "$dir" --rounds "${ROUNDS:-1}" "${variants[@]}" \
  --backend completions --dataset-name random-ids --num-prompts 512 --random-input-len 1000 \
  --random-output-len 1000 --random-range-ratio 1.0 --max-concurrency 256 --warmup-requests 1 \
  --disable-tqdm 2>&1 | tee "$dir/ab.txt"

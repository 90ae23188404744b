#!/usr/bin/env bash
# docs/PERF.md "Speculative decoding end to end": the Llama-3.1-8B shape (dummy weights) served plain and
# with the n-gram drafter (3 drafts), greedy, 512-token prompts and 256-token answers at 1, 8 and 64
# concurrent streams; each server's speculation metrics (accepted length, draft and verify time) after
# its runs. Dummy weights answer with loops the n-gram drafter finds, so the acceptance here is higher
# than real text's: the verify-step cost is the figure that carries over (verify_steps.sh).
# MODEL=v2lite: the DeepSeek-V2-Lite shape (MLA, 64 experts, dummy bf16) instead of Llama.
# Needs out/tokenizer (prepare_tokenizer.sh) carried with .gpu.
#   source .gpu/env.sh && [MODEL=v2lite] bash benchmarks/device/spec_e2e.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
model=${MODEL:-llama}
dir=$(results "spec_e2e_$model")
tok=$(tokenizer_dir)
describe_machine "$dir"
case $model in
  llama) base="--model llama-3.1-8b" ;;
  v2lite) write_v2lite_config "$dir/v2lite" && base="--model $dir/v2lite" ;;
  *) echo "MODEL: llama or v2lite, not $model" >&2 && exit 2 ;;
esac
base="$base --load-format dummy --device cuda --tokenizer $tok"

run_variant() {
  local name=$1 port=$2
  shift 2
  $PY -m runtime.cli serve $base --port "$port" "$@" >"$dir/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do
    curl -sf "localhost:$port/health" >/dev/null && break
    kill -0 $pid 2>/dev/null || { tail -30 "$dir/$name.server.log"; return 1; }
    sleep 1
  done
  for c in ${CONCURRENCY:-1 8 64}; do
    local n=$((c < 8 ? 8 : 2 * c))
    $PY -m loadgen serve --port "$port" --backend completions --dataset-name random-ids --num-prompts $n \
      --random-input-len 512 --random-output-len 256 --random-range-ratio 1.0 --max-concurrency "$c" \
      --temperature 0 --disable-tqdm --out "$dir/$name-c$c.json" 2>&1 | tee "$dir/$name-c$c.txt"
  done
  curl -s "localhost:$port/metrics" | grep -E "^conduit_(spec|engine_step|gpu_|scheduler_)" >"$dir/$name.metrics.txt" || true
  kill -INT $pid
  wait $pid || true
}

run_variant plain 31001
run_variant ngram 31002 --speculative-algorithm ngram --speculative-num-draft-tokens 3
grep -h "kv_pool\|cuda_graphs_captured" "$dir"/*.server.log | tee "$dir/pools.txt" || true

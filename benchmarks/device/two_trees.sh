#!/usr/bin/env bash
# Two source trees side by side in one call: the end-to-end Llama-3.1-8B benchmark of llama8b_e2e.sh
# (the tuned server, 512 requests of 1000/1000 tokens, 256 in flight) with the servers of both trees
# interleaved, then the MLA decode kernel (ours, both timers, pages shuffled) from each tree's own bench.
# For before/after checks of a change that should not move the figures. BEFORE: the other tree, e.g.
# `git archive <commit> | tar -x -C out/before` on this side, carried. PARTS: e2e, mla or both.
#   source .gpu/env.sh && BEFORE=out/before bash benchmarks/device/two_trees.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results two_trees)
before=$(cd "${BEFORE:?the other source tree}" && pwd)
here=$PWD
describe_machine "$dir"
parts=${PARTS:-e2e mla}
if [[ $parts == *e2e* ]]; then
  tok=$(cd "$(tokenizer_dir)" && pwd)
  flags="--model llama-3.1-8b --load-format dummy --device cuda --tokenizer $tok --kv-cache-dtype fp8_e4m3"
  flags="$flags --page-size 64 --chunked-prefill-size 32768 --max-running-requests 256 --max-total-tokens 600000"
  $PY -m loadgen ab --out-dir "$dir/e2e" --rounds "${ROUNDS:-1}" \
    --server-cmd "bash $here/benchmarks/device/serve_from.sh --host 127.0.0.1 --port {port}" \
    --variant before "$flags" --variant-env before "CODE=$before" \
    --variant after "$flags" --variant-env after "CODE=$here" \
    --backend completions --dataset-name random-ids --num-prompts 512 --random-input-len 1000 \
    --random-output-len 1000 --random-range-ratio 1.0 --max-concurrency 256 --warmup-requests 1 \
    --disable-tqdm 2>&1 | tee "$dir/e2e.txt"
fi
if [[ $parts == *mla* ]]; then
  for tree in before after; do
    src=$([ $tree = before ] && echo "$before" || echo "$here")
    module=$([ -f "$src/benchmarks/kernels/mla_decode.py" ] && echo benchmarks.kernels.mla_decode \
      || echo runtime.gpu.kernels.mla_decode.bench)
    echo "== $tree ($module)" | tee -a "$dir/mla.txt"
    (cd "$src" && $PY -m "$module" --impls tilelang --entries table --timers graph do_bench --pages shuffled \
      --rounds "${MLA_ROUNDS:-2}" --no-check) 2>&1 | tee -a "$dir/mla.txt"
  done
fi

#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash as stored": V4-Flash's FP4 experts, the tiles and K-step forms swept at
# decode and verify token counts (fused_moe_tune, compiled by JOBS processes in parallel first, then
# timed in one), and then the 8-layer cut's whole steps at choose_config's pick and at the sweep's best
# for 64 tokens, side by side on the same machine (v4_fp4_forms.sh). The compiled kernels' TTGIR comes
# back as ttgir.tar.gz. About 8 minutes on an H100.
#   source .gpu/env.sh && bash benchmarks/device/v4_fp4_tune.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_fp4_tune)
describe_machine "$dir"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
sweep=(--models v4 --tokens "${TOKENS:-64,256}" --block-m "${BLOCK_M:-16}" --block-n "${BLOCK_N:-64,128,256}"
  --block-k "${BLOCK_K:-64,128,256,512}" --schedules "${SCHEDULES:-4:2,4:3,4:4,8:3,8:4}"
  --fp4-steps "${FP4_STEPS:-scaled}")
jobs=${JOBS:-12}
for i in $(seq 0 $((jobs - 1))); do
  $PY -m benchmarks.kernels.fused_moe_tune "${sweep[@]}" --compile-only --shard "$i/$jobs" > "$dir/compile-$i.txt" 2>&1 &
done
wait
tail -n 2 "$dir"/compile-*.txt | grep -v "^$" | head -40
$PY -m benchmarks.kernels.fused_moe_tune "${sweep[@]}" --top 10 --best-out "$dir/best.txt" 2>&1 | tee "$dir/tune.txt"
(cd "$TRITON_CACHE_DIR" && find . -name "*fp4*.ttgir" | tar czf - -T -) > "$dir/ttgir.tar.gz" || true
if [ "${STEPS:-1}" = 1 ]; then
  read -r _ _ tile step _ < <(grep "^v4 64 " "$dir/best.txt" | tail -1)
  FORMS="scaled $step@$tile" PREFILL="${PREFILL-}" bash "$(dirname "$0")/v4_fp4_forms.sh" 2>&1 | tee "$dir/steps.txt"
fi

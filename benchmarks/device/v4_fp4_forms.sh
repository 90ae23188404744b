#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash as stored": the FP4 experts' K-step forms (MoEConfig.fp4_step, forced per
# process by CONDUIT_FP4_MOE_STEP) in whole steps of the 8-layer V4-Flash cut as stored (--quantization
# fp8: FP8 projections, FP4 routed experts; 30.8 GB, fits an H100), dummy weights, balanced routing,
# pages of 128: decode k=0 and verify k=3 at context 8K (B = 8, 64) and a 4K-token prefill, one process
# per form. FORMS picks the forms (default: the Triton `dot_scaled` one, then the mma kernels); a form may name a decode
# tile too, `step@block_m,block_n,block_k,warps,stages` (CONDUIT_FP4_MOE_DECODE_TILE);
# EXTRA="--profile-steps 1" adds each point's kernel table; PREFILL="" skips the prefill point.
# About 2 minutes a form on an H100.
#   source .gpu/env.sh && bash benchmarks/device/v4_fp4_forms.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_fp4_forms)
describe_machine "$dir"
for form in ${FORMS:-scaled mma}; do
  step=${form%%@*}
  tile=""
  [[ $form == *@* ]] && tile=${form#*@}
  echo "== form $step, decode tile ${tile:-from choose_config}" | tee -a "$dir/steps.txt"
  CONDUIT_FP4_MOE_STEP=$step CONDUIT_FP4_MOE_DECODE_TILE=$tile $PY -m loadgen steps --model-path deepseek-v4-flash \
    --quantization fp8 --hf-overrides "$V4_OVERRIDES" --page-size 128 --batch-sizes ${BATCHES:-8,64} \
    --context-len 8192 --draft-tokens 0,3 --prefill-tokens "${PREFILL-4096}" --steps 10 ${EXTRA:-} 2>&1 \
    | tee -a "$dir/steps.txt"
done

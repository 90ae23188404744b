#!/usr/bin/env bash
# docs/PERF.md "DeepSeek-V4-Flash verify steps": the indexer of decode and verify rows through the
# `row_index_scores` kernel against its reference (each row's keys gathered as float32, every head's
# scores materialised: what the batched path did before), forced per process by
# CONDUIT_KERNEL_ROW_INDEX_SCORES. The 8-layer V4-Flash cut, dummy weights (bf16 where the card holds
# 107.5 GB, else as stored: --quantization fp8), pages of 128, k = 0 and 3 in one process per (kernel,
# context): context 8K (B = 8, 64), then 128K (B = 32; LONG=0 skips it). About 4 minutes on an H100.
#   source .gpu/env.sh && bash benchmarks/device/v4_indexer_rows.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results v4_indexer_rows)
describe_machine "$dir"
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
quant=()
[ "$mib" -lt 120000 ] && quant=(--quantization fp8)
common=(--model-path deepseek-v4-flash "${quant[@]}" --hf-overrides "$V4_OVERRIDES" --page-size 128
        --prefill-tokens "" --draft-tokens 0,3 --steps 10 ${EXTRA:-})
for impl in ${IMPLS:-reference triton}; do
  CONDUIT_KERNEL_ROW_INDEX_SCORES=$impl $PY -m loadgen steps "${common[@]}" --batch-sizes ${BATCHES:-8,64} \
    --context-len 8192 2>&1 | tee "$dir/ctx8k-$impl.txt"
  if [ "${LONG:-1}" = 1 ]; then
    CONDUIT_KERNEL_ROW_INDEX_SCORES=$impl $PY -m loadgen steps "${common[@]}" --batch-sizes 32 \
      --context-len 131072 2>&1 | tee "$dir/ctx128k-$impl.txt"
  fi
done

#!/usr/bin/env bash
# docs/PERF.md "MLA decode against FlashMLA": our TileLang MLA decode beside DeepSeek's FlashMLA in the
# same process, at FlashMLA's benchmark points, both timers, both page layouts, round-robin over 3
# rounds; each line also reads as a percentage of FlashMLA's time (`vs here`). FlashMLA is not in the
# repository: build it from its source into a directory holding an importable `flash_mla` package
# (FLASHMLA_DIR, default out/flashmla) and carry it. Without it, ours is timed alone and compared with
# FlashMLA's fixed H200 figures only. About 6 minutes.
#   source .gpu/env.sh && bash benchmarks/device/mla_decode.sh
set -euo pipefail
source "$(dirname "$0")/lib.sh"
dir=$(results mla_decode)
describe_machine "$dir"
flashmla=${FLASHMLA_DIR:-out/flashmla}
if [ -d "$flashmla" ]; then
  export PYTHONPATH="$PWD/$flashmla${PYTHONPATH:+:$PYTHONPATH}"
fi
impls=(tilelang flash_mla)
if ! $PY -c "import flash_mla" 2>/dev/null; then
  echo "flash_mla is not importable (FLASHMLA_DIR=$flashmla): timing ours alone" | tee "$dir/NOTE.txt"
  impls=(tilelang)
fi
$PY -m benchmarks.kernels.mla_decode --impls "${impls[@]}" --entries table --timers graph do_bench \
  --pages contiguous shuffled --rounds 3 2>&1 | tee "$dir/bench.txt"

